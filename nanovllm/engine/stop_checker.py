"""Why a sequence stops: EOS, a stop token, a stop string or its length. Decided in one place
(StopChecker.check); only the scheduler acts on the answer."""
from typing import NamedTuple

from nanovllm.engine.sequence import Sequence


class Stop(NamedTuple):
    """Why a sequence ended, as vLLM reports it."""
    finish_reason: str                     # "stop" (EOS, stop token or stop string) or "length"
    stop_reason: int | str | None = None   # the stop token id or stop string; None for EOS and length


# abort: the client went away, or a grammar rejected a token (its bitmask should have forbidden it)
EOS, LENGTH, ABORT = Stop("stop"), Stop("length"), Stop("abort")
POOLED = Stop("stop")   # a prompt-only (pooling) request, once its output is pooled


class StopChecker:
    """tokenizer: needed only by requests with stop strings (the engine refuses those without one).
    secondary_eos_token_ids: the EOS ids besides the tokenizer's own (generation_config.json's
    others), reported as vLLM reports them: stop_reason = the id, as a stop token."""

    def __init__(self, eos_token_ids: set[int], max_model_len: int, tokenizer=None,
                 secondary_eos_token_ids: frozenset[int] = frozenset()):
        self.eos_token_ids = eos_token_ids
        self.secondary_eos_token_ids = secondary_eos_token_ids
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer

    def check(self, seq: Sequence, token_id: int) -> Stop | None:
        """Does seq stop on token_id, just appended to it? EOS and stop tokens come first, then stop
        strings, then the length limits. min_tokens holds off all but the length limits."""
        params = seq.sampling_params
        if seq.grammar is not None and (seq.grammar.rejected or seq.grammar.is_terminated):
            # Terminated: the grammar was complete and took EOS (it ends even with ignore_eos).
            return ABORT if seq.grammar.rejected else self._eos(token_id)
        counts = seq.num_completion_tokens >= params.min_tokens
        if counts:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return self._eos(token_id)
            if token_id in params.stop_token_ids:
                return Stop("stop", token_id)
        if seq.detokenizer is not None:   # only requests with stop strings pay for detokenizing
            # Stop strings are looked for only in the text of the tokens after the first min_tokens
            # (vLLM: once the output is longer than min_tokens); stop tokens from min_tokens on,
            # where the sampler stops banning them.
            stop = self._stop_string(seq, seq.num_completion_tokens > params.min_tokens)
            if stop is not None:
                return Stop("stop", stop)   # it wins over a length limit reached by the same token
        if self.length_reached(seq, len(seq.token_ids)):
            return LENGTH
        return None

    def _eos(self, token_id: int) -> Stop:
        # vLLM reports the tokenizer's EOS as stop with no stop_reason, the others by id
        return Stop("stop", token_id) if token_id in self.secondary_eos_token_ids else EOS

    def _stop_string(self, seq: Sequence, counts: bool) -> str | None:
        # Every token is detokenized (also those min_tokens holds off): the text grows incrementally.
        detok, params = seq.detokenizer, seq.sampling_params
        new_text = detok.step(self.tokenizer, seq.completion_token_ids, params.skip_special_tokens,
                              params.spaces_between_special_tokens)
        if not counts:
            return None
        return detok.find_stop(len(new_text), params.stop, params.include_stop_str_in_output)

    def length_reached(self, seq: Sequence, num_tokens: int) -> bool:
        """Does a sequence of num_tokens tokens end by max_tokens or max_model_len?"""
        max_tokens = seq.sampling_params.max_tokens
        return (max_tokens is not None and num_tokens - seq.num_prompt_tokens >= max_tokens) \
            or num_tokens >= self.max_model_len
