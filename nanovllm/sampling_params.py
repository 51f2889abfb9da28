"""SamplingParams: vLLM's fields, defaults and meanings; bad values raise ValueError naming the field."""
import copy
import numbers
from dataclasses import dataclass

import numpy as np

from nanovllm.beam_search import BeamSearchParams  # noqa: F401  (vllm.sampling_params has it too)
from nanovllm.structured.params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams"]

_EPS = 1e-5   # temperatures below this are greedy, as in vLLM


@dataclass
class SamplingParams:
    n: int = 1                              # completions per prompt
    presence_penalty: float = 0.0           # subtracted once from every token already in the output
    frequency_penalty: float = 0.0          # subtracted per occurrence in the output
    repetition_penalty: float = 1.0         # > 1 discourages tokens of the prompt and the output
    temperature: float = 1.0                # 0 means greedy (argmax)
    top_p: float = 1.0                      # keep the smallest set of tokens whose probability >= top_p
    top_k: int = 0                          # keep the k most likely tokens; 0 or -1 = off
    min_p: float = 0.0                      # drop tokens less likely than min_p * the top probability
    seed: int | None = None                 # per request: same seed, same tokens, whatever the batch
    stop: str | list[str] | None = None     # strings that end the output (found across tokens)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16             # None: up to max_model_len
    min_tokens: int = 0                     # EOS and stop tokens cannot end the output before this
    logprobs: int | None = None             # top-k log probabilities per output token (+ the sampled one);
                                            # True means 1, -1 the whole vocabulary
    prompt_logprobs: int | None = None      # the same for each prompt token (RequestOutput.prompt_logprobs)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True                        # False: outputs carry token ids only (text "")
    logit_bias: dict[int, float] | None = None     # token id -> added to its logit, clamped to [-100, 100]
    allowed_token_ids: list[int] | None = None     # only these tokens may be sampled
    bad_words: list[str] | None = None             # words never generated (as in vLLM: their last token
                                                   # is banned where the output ends in the rest of them)
    structured_outputs: StructuredOutputsParams | None = None   # constrain the output (xgrammar)
    guided_decoding: StructuredOutputsParams | None = None      # vLLM's older name for the same
    truncate_prompt_tokens: int | None = None      # keep only the prompt's last k tokens (-1: as many
                                                   # as max_model_len leaves room for, one output token)

    def __post_init__(self):
        self.validate()

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's), to change one request's settings without touching another's."""
        return copy.deepcopy(self)

    @classmethod
    def from_optional(cls, **fields) -> "SamplingParams":
        """vLLM's: SamplingParams(**fields), a field given as None taking its default."""
        return cls(**{k: v for k, v in fields.items() if v is not None})

    def validate(self):
        """Check every field and normalise it (numpy scalars become Python numbers, one stop string
        or id becomes a list). Run on construction and again by the engine, since fields may be
        changed after construction."""
        _check_int(self, "n", 1)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(self, name, lambda v: -2.0 <= v <= 2.0, "in [-2, 2]")
        _check_float(self, "repetition_penalty", lambda v: v > 0, "> 0 (1 = off)")
        _check_float(self, "temperature", lambda v: v >= 0, ">= 0 (0 = greedy)")
        _check_float(self, "top_p", lambda v: 0 < v <= 1, "in (0, 1]")
        if _not_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer: -1 or 0 (off) or >= 1, got {self.top_k!r}")
        self.top_k = int(self.top_k)
        _check_float(self, "min_p", lambda v: 0 <= v <= 1, "in [0, 1]")
        if self.seed is not None and _not_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        self.seed = None if self.seed in (None, -1) else int(self.seed)   # vLLM: -1 means unseeded
        self.stop = _string_list(self.stop)
        self.stop_token_ids = _token_list(self.stop_token_ids)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
            setattr(self, name, bool(getattr(self, name)))
        if self.max_tokens is not None:
            _check_int(self, "max_tokens", 1)
        _check_int(self, "min_tokens", 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            _check_num_logprobs(self, name)
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != -1:
            _check_int(self, "truncate_prompt_tokens", 1)
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_list(self.allowed_token_ids, "allowed_token_ids")
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (None allows every token)")
        if self.bad_words is not None:
            self.bad_words = _string_list(self.bad_words, "bad_words")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (use stop_token_ids)")
        self.structured_outputs = _structured(self)
        if self.greedy:
            # Truncation changes nothing for an argmax; clearing it keeps greedy rows on the fast path.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _structured(params: SamplingParams) -> StructuredOutputsParams | None:
    """structured_outputs, or guided_decoding (vLLM's older name); a dict becomes the dataclass.
    Given guided_decoding, both end up as one object, so validating again (or dataclasses.replace)
    sees one constraint."""
    if params.structured_outputs is not None and params.guided_decoding is not None \
            and params.structured_outputs is not params.guided_decoding:
        raise ValueError("give structured_outputs or guided_decoding (its older name), not both")
    value = params.structured_outputs if params.structured_outputs is not None else params.guided_decoding
    if isinstance(value, dict):
        value = StructuredOutputsParams(**value)
    if params.guided_decoding is not None:
        params.guided_decoding = value
    if value is not None and not isinstance(value, StructuredOutputsParams):
        raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {type(value).__name__}")
    if value is not None and params.min_tokens > 0:
        # The grammar decides where the output may end; banning EOS could leave no token allowed.
        raise ValueError("min_tokens cannot be combined with structured_outputs: the grammar decides "
                         "where the output ends")
    return value


def _not_int(value) -> bool:
    """Not an int (numpy integers are ints; bools are not)."""
    if type(value) is int:   # the common case first: the ABC check below is slow
        return False
    return isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral)


def _check_int(params, name: str, minimum: int):
    value = getattr(params, name)
    if _not_int(value) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    setattr(params, name, int(value))


def _check_float(params, name: str, ok, allowed: str):
    value = getattr(params, name)
    is_number = type(value) is float or (isinstance(value, numbers.Real)
                                         and not isinstance(value, (bool, np.bool_)))
    if not is_number or not ok(value):
        raise ValueError(f"{name} must be a number {allowed}, got {value!r}")
    setattr(params, name, float(value))


def _string_list(stop, name: str = "stop") -> list[str]:
    if isinstance(stop, (bytes, bytearray)) or not (stop is None or hasattr(stop, "__iter__")):
        raise TypeError(f"{name} must be a str or a list of str, got {type(stop).__name__} {stop!r:.40}")
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"{name} must be a non-empty string or a list of them, got {stop!r}")
    return stop


def _token_list(ids, name: str = "stop_token_ids") -> list[int]:
    """One id or a list of them (as stop takes one string or a list)."""
    if ids is None:
        return []
    if not _not_int(ids):
        ids = [ids]
    elif isinstance(ids, (str, bytes, bytearray)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"{name} must be an integer or a list of integers >= 0, "
                        f"got {type(ids).__name__}")
    ids = list(ids)
    if any(_not_int(t) or t < 0 for t in ids):
        raise ValueError(f"{name} must be a list of integers >= 0, got {ids!r}")
    return [int(t) for t in ids]


def _check_num_logprobs(params, name: str):
    """None, True (= 1), -1 (the whole vocabulary) or an integer >= 0, as vLLM takes them."""
    value = getattr(params, name)
    if value is True:
        setattr(params, name, 1)
    elif value is not None and (_not_int(value) or value < -1):
        raise ValueError(f"{name} must be an integer >= 0, -1 (the whole vocabulary) or None, got {value!r}")


def _logit_bias(bias) -> dict[int, float] | None:
    """{token id: bias}; keys may be digit strings (as JSON writes them); values clamped to [-100, 100]
    as in vLLM."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict {{token id: bias}}, got {bias!r}")
    out = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else key
        if _not_int(token) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise ValueError(f"logit_bias[{key!r}] must be a number, got {value!r}")
        out[token] = min(max(float(value), -100.0), 100.0)
    return out
