"""Turns the waiting and running queues into one batch per step, and applies its results."""
from collections import deque
from dataclasses import dataclass, field

from nanovllm.engine.block_manager import BlockManager, KVCopy
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.engine.stop_checker import LENGTH, POOLED, Stop, StopChecker
from nanovllm.spec.ngram import can_speculate


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]        # in the order the model runner lays out their tokens
    # Query rows each sequence computes this step: a prefill chunk; 1 for decode; 1 + k to verify k
    # draft tokens. The one rule for "tokens a step": everything below derives from it.
    num_new_tokens: list[int]
    is_prefill: bool
    # Sequences ended while scheduling (they outgrew the whole KV cache); not run, but reported
    # by complete with the step's other finished sequences.
    finished: list[Sequence] = field(default_factory=list)
    # Prefix-cache partial hits: K/V rows copied between blocks before the step (BlockManager).
    kv_copies: list[KVCopy] = field(default_factory=list)
    # Decode while the batch before is in flight: per sequence, the row of that batch's sampled
    # tokens (on the device) holding its input token, -1 where the host has it. Set at launch by
    # RunAhead (run_ahead.py), which keeps what is in flight.
    token_rows: list[int] | None = None
    # Speculative decoding: per sequence, the draft tokens its rows verify after its known tokens
    # ([] for none; the last len(draft) of its num_new_tokens). None: no sequence has drafts. A batch
    # with drafts runs through the prefill path (query rows after a cached prefix) and never runs
    # ahead: its new tokens, and how many, are known only after verification.
    draft_tokens: list[list[int]] | None = None
    # Per sequence: does this step reach the end of its tokens, so a token is sampled for it? Fixed
    # when the batch is made (advance then moves num_computed_tokens on).
    samples: list[bool] = field(init=False)
    # The same for a prompt-only (pooling) sequence: this step ends it, its output pooled, not sampled.
    pools: list[bool] = field(init=False)

    def __post_init__(self):
        drafts = self.draft_tokens or [[]] * len(self.seqs)
        ends = [seq.num_computed_tokens + n - len(d) == seq.num_tokens
                for seq, n, d in zip(self.seqs, self.num_new_tokens, drafts)]
        self.samples = [end and seq.pooling is None for seq, end in zip(self.seqs, ends)]
        self.pools = [end and seq.pooling is not None for seq, end in zip(self.seqs, ends)]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def num_known_tokens(self, i: int) -> int:
        """Rows of sequence i whose tokens are known (computed for good): all but its drafts."""
        return self.num_new_tokens[i] - (len(self.draft_tokens[i]) if self.draft_tokens else 0)

    @property
    def sampling_seqs(self) -> list[Sequence]:
        """The sequences a token is sampled for, in batch order (the order of the sampled tokens)."""
        return [seq for seq, samples in zip(self.seqs, self.samples) if samples]


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 num_blocks: int, block_size: int, eos_token_ids: set[int],
                 enable_prefix_caching: bool = True, tokenizer=None,
                 secondary_eos_token_ids: frozenset[int] = frozenset(), max_loras: int = 0,
                 num_state_slots: int = 0, proposer=None):
        """tokenizer: for stop strings; secondary_eos_token_ids: see StopChecker; max_loras: the
        most distinct LoRA adapters among the running sequences (their GPU slots; 0: LoRA off);
        num_state_slots: rows of the per-sequence state cache (0: the model keeps none); proposer:
        speculative decoding's draft proposer (spec/ngram.py; None: off)."""
        self.proposer = proposer
        self.max_loras = max_loras
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.stop_checker = StopChecker(eos_token_ids, max_model_len, tokenizer, secondary_eos_token_ids)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching, num_state_slots)
        # The head of `waiting` may be a prompt part-way through a chunked prefill (it holds blocks).
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def reset(self):
        """Forget every queued sequence and free every block, as at start-up (after a failure
        part-way through a step; the engine ends the sequences themselves)."""
        self.waiting.clear()
        self.running.clear()
        self.block_manager.reset()

    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        """Prefill first (within max_num_batched_tokens, the last prompt possibly chunked); decode
        (one token per running sequence, within max_num_seqs) only when no prefill can run."""
        batch = self._schedule_prefill()
        if not batch.seqs:
            finished, batch = batch.finished, self._schedule_decode()
            batch.finished = finished
        return batch

    def _schedule_prefill(self) -> ScheduledBatch:
        seqs, counts, finished = [], [], []
        budget = self.max_num_batched_tokens
        # The adapters of the running sequences: a prompt of another one waits while all slots are
        # taken, and the prompts behind it go first (as vLLM skips it), keeping their order.
        adapters = {s.lora_int_id for s in self.running} - {None} if self.max_loras else set()
        i = 0   # waiting[:i]: prompts skipped for want of an adapter slot
        # Every sequence already in `seqs` is in `running` too, except a chunk, which ends the loop,
        # and the prompt-only ones (pooled: they end with this step, in no queue).
        pooled = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) + pooled < self.max_num_seqs:
            seq = self.waiting[i]
            lora = seq.lora_int_id
            if lora is not None and lora not in adapters:
                if len(adapters) >= self.max_loras:
                    i += 1
                    continue
                adapters.add(lora)
            if not seq.block_table:
                if not self.block_manager.can_allocate(seq):
                    if not seqs and not self.running:
                        self._finish_oversized(seq)   # it can never fit: stop it, don't hang
                        finished.append(seq)
                        continue
                    break
                self.block_manager.allocate(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            seqs.append(seq)
            counts.append(n)
            budget -= n
            if seq.num_computed_tokens + n < seq.num_tokens:
                if i:   # a chunk: the rest of this prompt goes first in the next step
                    del self.waiting[i]
                    self.waiting.appendleft(seq)
                break
            del self.waiting[i]
            seq.status = SequenceStatus.RUNNING
            if seq.pooling is None:
                self.running.append(seq)
            else:
                pooled += 1
        return ScheduledBatch(seqs, counts, is_prefill=True, finished=finished,
                              kv_copies=self.block_manager.take_copies())

    def _schedule_decode(self) -> ScheduledBatch:
        seqs = []
        # Each decode sequence computes one token, so the token budget caps the batch too.
        done = []   # their pending token is their last: nothing more to compute
        while self.running and len(seqs) < min(self.max_num_seqs, self.max_num_batched_tokens):
            seq = self.running.popleft()
            if seq.num_pending and self.stop_checker.length_reached(seq, seq.num_tokens):
                done.append(seq)
                continue
            while not self.block_manager.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())   # the newest sequence makes room
                else:
                    self._preempt(seq)
                    break
            else:
                self.block_manager.may_append(seq)
                seqs.append(seq)
        self.running.extendleft(reversed(seqs + done))
        drafts = self._propose_all(seqs) if self.proposer is not None else []
        if not any(drafts):
            return ScheduledBatch(seqs, [1] * len(seqs), is_prefill=False)
        return ScheduledBatch(seqs, [1 + len(d) for d in drafts], is_prefill=False, draft_tokens=drafts)

    def _propose_all(self, seqs: list[Sequence]) -> list[list[int]]:
        """Draft tokens for each scheduled decode sequence, once every one has its slot: drafts take
        only the token budget and blocks left over, so they never preempt a sequence."""
        rows = self.max_num_batched_tokens - len(seqs)
        drafts = []
        for seq in seqs:
            draft = self._propose(seq, rows)
            rows -= len(draft)
            drafts.append(draft)
        return drafts

    def _propose(self, seq: Sequence, max_drafts: int) -> list[int]:
        """seq's drafts within max_drafts, its length limits (max_tokens, max_model_len) and free blocks."""
        if max_drafts <= 0 or not can_speculate(seq):
            return []
        max_tokens = seq.sampling_params.max_tokens
        if max_tokens is not None:   # the step gives up to len(draft) + 1 tokens
            max_drafts = min(max_drafts, max_tokens - seq.num_completion_tokens - 1)
        draft = self.proposer.propose(seq.token_ids, min(max_drafts, self.max_model_len - seq.num_tokens))
        while draft and not self.block_manager.can_append(seq, len(draft)):
            draft.pop()
        self.block_manager.may_append(seq, len(draft))
        return draft

    def _preempt(self, seq: Sequence):
        """Recompute preemption: drop all of seq's blocks; it is prefilled again (prompt and output
        so far) when blocks are free, which under greedy sampling gives the same continuation."""
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def _finish_oversized(self, seq: Sequence):
        # Only a sequence that grew past the whole cache gets here (prompts are checked on entry).
        self.waiting.remove(seq)
        self._finish(seq, LENGTH)

    def postprocess(self, batch: ScheduledBatch, token_ids: list[int],
                    logprobs: list | None = None) -> list[Sequence]:
        """advance then complete: apply a step whose tokens are already on the host."""
        self.advance(batch)
        return self.complete(batch, token_ids, logprobs)

    def advance(self, batch: ScheduledBatch):
        """Right after the batch is launched: its tokens are computed (in stream order) and each
        sequence that samples has one pending token, so the next batch can be scheduled before
        this one's tokens reach the host. A sequence that the batch before finished meanwhile
        (applied while this batch was launched) is left as it is."""
        for i, (seq, samples) in enumerate(zip(batch.seqs, batch.samples)):
            if seq.is_finished:
                continue
            # Drafts' rows are written to the cache but count as computed only once accepted (complete).
            seq.num_computed_tokens += batch.num_known_tokens(i)
            seq.num_pending += samples
            self.block_manager.register_computed(seq)   # prompts share its blocks from the next step on

    def complete(self, batch: ScheduledBatch, token_ids: list[int],
                 logprobs: list | None = None) -> list[Sequence]:
        """The batch's sampled tokens reached the host (one per sequence that sampled, in batch
        order; with their logprobs when given): append them, register the blocks now full, finish
        the sequences they stop, and return the sequences that finished. A sequence that finished
        (or was preempted) after this batch was launched just drops its pending token."""
        finished, sampled = list(batch.finished), iter(token_ids)
        sampled_logprobs = iter(logprobs if logprobs is not None else [None] * len(token_ids))
        drafts = batch.draft_tokens or [[]] * len(batch.seqs)
        for seq, samples, pools, draft in zip(batch.seqs, batch.samples, batch.pools, drafts):
            token_id = next(sampled) if samples else None
            token_logprobs = next(sampled_logprobs) if samples else None
            if seq.is_finished:
                continue
            if pools:   # its output is pooled (layers/pooler.py): it ends, its blocks freed at once
                self._finish(seq, POOLED)
                finished.append(seq)
                continue
            stop = None
            if samples:
                seq.num_pending -= 1
                # A verify step gives a list: its accepted drafts, then one more token.
                new = token_id if isinstance(token_id, list) else [token_id]
                new_logprobs = token_logprobs if isinstance(token_id, list) else [token_logprobs]
                stop = self._append_tokens(seq, new, new_logprobs or [None] * len(new))
                if draft:
                    seq.num_drafts += 1
                    seq.num_draft_tokens += len(draft)
                    seq.num_accepted_tokens += len(new) - 1
                    if stop is None:   # the accepted drafts' rows are computed; the rejected ones' blocks go
                        seq.num_computed_tokens += len(new) - 1
                        self.block_manager.free_rejected(seq)
            self.block_manager.register_computed(seq)
            if stop is not None:
                self.finish(seq, stop)
                finished.append(seq)
        return finished

    def _append_tokens(self, seq: Sequence, token_ids: list[int], logprobs: list) -> Stop | None:
        """Append tokens in order, checking each: the first that stops the sequence is its last
        (as without speculation); the rest are dropped."""
        for token_id, token_logprobs in zip(token_ids, logprobs):
            seq.append_token(token_id, token_logprobs)
            stop = self.stop_checker.check(seq, token_id)
            if stop is not None:
                return stop
        return None

    def finish(self, seq: Sequence, stop: Stop):
        """End a sequence, for the reason given; free its blocks."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._finish(seq, stop)

    def _finish(self, seq: Sequence, stop: Stop):
        # The only place a sequence's finish_reason and stop_reason are written.
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = stop
        seq.num_pending = 0   # a token still in flight is dropped
        if seq.block_table:
            self.block_manager.deallocate(seq)
