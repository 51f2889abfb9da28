from enum import Enum, auto
from itertools import count
from typing import NamedTuple

from nanovllm.engine.detokenizer import IncrementalDetokenizer, prompt_context
from nanovllm.sampling_params import SamplingParams


class TokenLogprobs(NamedTuple):
    """Log probabilities for one output token (of the raw model output, as vLLM v1 reports)."""
    logprob: float            # of the sampled token
    rank: int                 # of the sampled token, 1 = most likely
    top_ids: list[int]        # the request's `logprobs` most likely tokens, descending
    top_logprobs: list[float]


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One request: its tokens, how many of them have K/V in the cache, and its blocks."""
    _ids = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams | None = None,
                 index: int = 0, eos_token_ids: frozenset[int] = frozenset(), grammar=None,
                 lora_request=None, pooling=None):
        """grammar: a GrammarState (nanovllm/structured) when the request has structured_outputs;
        lora_request: the LoRARequest of its adapter (None: the base model); pooling: a
        SequencePooling (layers/pooler.py) for a prompt-only request, pooled instead of sampled."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        self.seq_id = next(Sequence._ids)
        self.index = index   # which of the request's n completions this is
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.sampling_params = sampling_params
        self.lora_request = lora_request
        # Invariant: the first num_computed_tokens tokens have their K/V in the blocks of block_table.
        self.num_computed_tokens = 0
        # Tokens sampled on the device whose ids the host has not seen yet (0, or 1 while the engine
        # runs one step ahead). They count in num_tokens but are not in token_ids.
        self.num_pending = 0
        self.block_table: list[int] = []
        # Its row of the per-sequence state cache (linear attention), held with its blocks; else None.
        self.state_slot: int | None = None
        # block_hashes[i] is the prefix-cache hash of block i; only full, computed blocks have one.
        self.block_hashes: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # Sampling state. Tokens that may not be sampled before min_tokens outputs: stop tokens and
        # EOS, also with ignore_eos (as vLLM does: its min-tokens processor bans the model's EOS
        # whatever ignore_eos says).
        p = sampling_params
        self.min_tokens_banned = frozenset(p.stop_token_ids) | eos_token_ids
        self.logprobs: list[TokenLogprobs] | None = [] if p.logprobs is not None else None
        # prompt_logprobs[i] is for prompt token i + 1 (the first token has none), filled by prefill.
        self.prompt_logprobs: list[TokenLogprobs] | None = [] if p.prompt_logprobs is not None else None
        self.bad_words_ids: list[list[int]] = []   # bad_words as token ids (set by the engine's tokenizer)
        self.num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache (set once)
        # Speculative decoding: draft tokens verified for this sequence, and how many were accepted.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.text_context = prompt_context(self.token_ids)   # the output's text reads behind these
        self.detokenizer = IncrementalDetokenizer(self.text_context) if p.stop else None
        # The grammar's state follows the appended output tokens (so preemption keeps it).
        self.grammar = grammar
        self.pooling = pooling

    def __len__(self):
        return self.num_tokens

    @property
    def num_tokens(self) -> int:
        """Tokens the KV cache must hold: the known ones and the pending one."""
        return len(self.token_ids) + self.num_pending

    @property
    def lora_int_id(self) -> int | None:
        return None if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_completion_tokens(self) -> int:
        """Output tokens the host knows."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_index(self) -> int:
        """The index, among the outputs, of the token the next step samples for this sequence."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Are prompt logprobs still to be computed? Until they are, the prefix cache is not used
        for this sequence (every prompt position must be computed, as in vLLM)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def skips_prefix_cache(self) -> bool:
        """Must every prompt position be computed, reading no cached prefix? While prompt logprobs
        are wanted, and for a pooler that reads every position (all but last-token pooling)."""
        return self.wants_prompt_logprobs or (self.pooling is not None and self.pooling.reads_every_position)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def abort(self):
        """End an unfinished sequence with finish_reason "abort" (as vLLM reports an aborted
        request) after its engine failed part-way through a step; it keeps its tokens, no blocks."""
        if self.is_finished:
            return
        self.status = SequenceStatus.FINISHED
        self.finish_reason = "abort"
        self.num_pending = 0
        self.block_table = []
        self.block_hashes = []
        self.state_slot = None
        self.num_computed_tokens = 0

    def append_token(self, token_id: int, logprobs: "TokenLogprobs | None" = None):
        self.token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
