"""speculative_config as vLLM takes it: a dict (or a SpeculativeConfig), validated with ValueErrors."""
import numbers
from dataclasses import dataclass

import numpy as np

METHODS = ("ngram",)
# vLLM's default when neither n-gram bound is given (its values are arbitrary too).
DEFAULT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str                  # "ngram": prompt lookup over the sequence's own tokens
    num_speculative_tokens: int  # k: draft tokens proposed per sequence per step (the step has k + 1 rows)
    prompt_lookup_max: int       # the longest suffix n-gram looked up
    prompt_lookup_min: int       # the shortest

    @classmethod
    def of(cls, value) -> "SpeculativeConfig | None":
        """None, a SpeculativeConfig, or vLLM's dict: {"method": "ngram", "num_speculative_tokens": k,
        "prompt_lookup_max": ..., "prompt_lookup_min": ...} (each bound defaults to the other, both to 5)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict such as {{'method': 'ngram', "
                             f"'num_speculative_tokens': 3}} or None, got {value!r}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key{'s' if len(unknown) > 1 else ''} "
                             f"{', '.join(map(repr, unknown))}; nanovllm takes {', '.join(sorted(known))} "
                             f"(draft models and EAGLE are not supported: use method='ngram')")
        method = value.get("method", "ngram" if "prompt_lookup_max" in value or "prompt_lookup_min" in value
                           else None)
        if method not in METHODS:
            raise ValueError(f"speculative_config: unknown method {method!r}; supported: "
                             f"{', '.join(map(repr, METHODS))}")
        k = _positive_int(value.get("num_speculative_tokens"), "num_speculative_tokens")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = DEFAULT_LOOKUP
        lo = _positive_int(hi if lo is None else lo, "prompt_lookup_min")
        hi = _positive_int(lo if hi is None else hi, "prompt_lookup_max")
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= "
                             f"prompt_lookup_max ({hi})")
        return cls(method, k, hi, lo)


def _positive_int(value, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {value!r}")
    return int(value)
