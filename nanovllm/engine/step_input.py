"""StepInput: what every tensor-parallel rank needs to run one model step, and no more.

Rank 0 builds it from the ScheduledBatch and sends it to the other ranks (pickled through shared
memory), so it is flat lists of ints rather than Sequence objects: a decode step carries one token
per sequence, never the whole history. When the engine runs a step ahead, a decode sequence's input
token may still be on the device only: then its id here is 0 and `token_rows` says which row of the
previous step's sampled tokens (kept on every rank's device) holds it (see run_ahead.py)."""
from dataclasses import dataclass

from nanovllm.engine.scheduler import ScheduledBatch


@dataclass
class StepInput:
    is_prefill: bool               # the prefill path: prompts, or decode rows that verify drafts
    seq_ids: list[int]
    starts: list[int]              # tokens of each sequence already in the KV cache (num_computed_tokens)
    token_ids: list[list[int]]     # tokens each sequence computes now: a prefill chunk, [last token], or
                                   # [last token] + drafts (speculative decoding)
    block_tables: list[list[int]]
    samples: list[bool]            # this step reaches the sequence's end, so its logits are sampled
    token_rows: list[int] | None = None   # decode: row of the previous step's sampled tokens that is
                                          # this sequence's input (-1: the id is in token_ids)
    prompt_logprob_counts: list[int] | None = None   # prefill: positions from `start` on whose logits are
                                          # also computed (for prompt_logprobs); None when no sequence asks
    lora_slots: list[int] | None = None   # LoRA on: each sequence's adapter slot (-1: the base model)
    lora_loads: list | None = None        # (slot, LoRARequest): adapters every rank loads before the step
    kv_copies: list | None = None         # KVCopy (src, dst, tokens): rows every rank copies, in order
    state_slots: list[int] | None = None  # each sequence's state-cache row (a model with per-sequence
                                          # state, engine/state_slots.py); None: the model keeps none
    pooling: list[tuple[str, bool]] | None = None   # prompt-only step: per sequence, its pooling method
                                          # (layers/pooler.py) and whether this step ends its prompt
    logit_rows: list[int] | None = None   # per sampling sequence: its last rows whose logits are sampled
                                          # (1 + its drafts); None: one each

    @classmethod
    def of(cls, batch: ScheduledBatch, lora_slots=None) -> "StepInput":
        """lora_slots: rank 0's lora.slots.SlotTable when LoRA is on."""
        seqs = batch.seqs
        starts = [seq.num_computed_tokens for seq in seqs]
        token_ids = [seq.token_ids[s:s + n] for seq, s, n in zip(seqs, starts, batch.num_new_tokens)]
        logit_rows = None
        if batch.draft_tokens is not None:   # verify: the known token, then the drafts, all with logits
            token_ids = [ids + d for ids, d in zip(token_ids, batch.draft_tokens)]
            logit_rows = [1 + len(d) for d, samples in zip(batch.draft_tokens, batch.samples) if samples]
        if batch.token_rows is not None:   # a pending input token: its placeholder id is 0
            token_ids = [ids or [0] for ids in token_ids]
        else:
            assert not any(seq.num_pending for seq in seqs), "a pending input token needs its row"
        pooling = None
        if seqs and seqs[0].pooling is not None:   # the pooling runner's steps are all prompt-only
            pooling = [(seq.pooling.method, end) for seq, end in zip(seqs, batch.pools)]
        slots, loads = lora_slots.assign([seq.lora_request for seq in seqs]) if lora_slots else (None, None)
        is_prefill = batch.is_prefill or batch.draft_tokens is not None
        return cls(is_prefill, [seq.seq_id for seq in seqs], starts, token_ids,
                   [seq.block_table for seq in seqs], batch.samples, batch.token_rows,
                   prompt_logprob_counts(batch, starts), slots, loads,
                   batch.kv_copies or None, state_slots_of(seqs), pooling, logit_rows)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)


def state_slots_of(seqs) -> list[int] | None:
    slots = [seq.state_slot for seq in seqs]
    return None if not slots or slots[0] is None else slots


def prompt_logprob_counts(batch: ScheduledBatch, starts: list[int]) -> list[int] | None:
    """Per sequence: how many of this chunk's positions predict a prompt token (position p gives
    the logprob of prompt token p + 1) for a sequence that still wants its prompt logprobs. None
    when no position does: e.g. a prompt's last chunk of one token, its earlier chunks' logprobs
    not yet on the host (so it still wants them)."""
    if not batch.is_prefill or not any(seq.wants_prompt_logprobs for seq in batch.seqs):
        return None
    counts = [max(0, min(start + n, seq.num_prompt_tokens - 1) - start) if seq.wants_prompt_logprobs else 0
              for seq, start, n in zip(batch.seqs, starts, batch.num_new_tokens)]
    return counts if any(counts) else None
