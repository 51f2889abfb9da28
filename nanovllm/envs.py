"""Every environment variable nanovllm reads, declared here once with its type, default and meaning;
no other module reads os.environ (tests/test_envs.py checks).

A variable is read when its `get()` is called. The tuning knobs at the end are read once, when the
module that uses them is imported (`FOLD_NORMS = envs.FOLD_NORMS.get()` in models/llama.py): a
tensor-parallel worker is a fresh interpreter that inherits this process's environment, so a knob
set in the environment before nanovllm is imported reaches every rank, which a module attribute
patched in one process never did. `benchmarks/bench_with.py NAME=VALUE ... -- [bench.py args]`
checks the names against this list and sets them.
"""
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _bool(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError(f"use one of {', '.join(_TRUE + _FALSE)}")


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError("use a positive integer")
    return int(text)


def _non_negative_int(text: str) -> int:
    if not text.strip().isdigit():
        raise ValueError("use an integer >= 0")
    return int(text)


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text.lower() not in choices:
            raise ValueError(f"use one of {', '.join(choices)}")
        return text.lower()
    return parse


def _text(text: str) -> str:
    return text


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str                      # the variable, e.g. "NANOVLLM_LOGGING_LEVEL"
    parse: Callable[[str], T]      # its text -> its value; a ValueError says what is expected
    default: T                     # when it is unset or empty
    help: str                      # what it does (docs/options.md lists them all)
    knob: bool = False             # a tuning knob for benchmarks, read at import (see above)

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        """The variable's value in `environ` (default: this process's environment)."""
        text = (os.environ if environ is None else environ).get(self.name)
        if text is None or text == "":
            return self.default
        try:
            return self.parse(text)
        except ValueError as e:
            raise ValueError(f"{self.name}={text!r}: {e}") from None


# ---- what users set ---------------------------------------------------------------------------
LOGGING_LEVEL = EnvVar("NANOVLLM_LOGGING_LEVEL", _choice("debug", "info", "warning", "error", "critical"),
                       "info", "the level of nanovllm's log lines on stderr (as VLLM_LOGGING_LEVEL)")
CONFIGURE_LOGGING = EnvVar("NANOVLLM_CONFIGURE_LOGGING", _bool, True,
                           "0: nanovllm adds no handler; its records go to the application's logging "
                           "(as VLLM_CONFIGURE_LOGGING)")
KERNELS = EnvVar("NANOVLLM_KERNELS", _choice("triton", "torch"), None,
                 "force the kernels on CUDA: triton (the default where triton is installed) or torch "
                 "(the plain torch reference everywhere)")
ATTENTION_BACKEND = EnvVar("NANOVLLM_ATTENTION_BACKEND", _choice("triton", "torch"), None,
                           "the deprecated name of NANOVLLM_KERNELS, read when that is unset")
CACHE = EnvVar("NANOVLLM_CACHE", _text, None,
               "where the demo model is converted to (default $XDG_CACHE_HOME/nanovllm)")
GRAMMAR_THREADS = EnvVar("NANOVLLM_GRAMMAR_THREADS", _positive_int, 1,
                         "threads for structured outputs' bitmask fill (more pay only for heavy grammars)")
API_KEY = EnvVar("VLLM_API_KEY", _text, None, "nanovllm serve: the API key when --api-key is not given")

# ---- other tools' variables that nanovllm reads -----------------------------------------------
RAY_ADDRESS = EnvVar("RAY_ADDRESS", _text, None,
                     "data_parallel_size > 1: the Ray cluster to join (unset: start a local one)")
TRITON_INTERPRET = EnvVar("TRITON_INTERPRET", _bool, False,
                          "1: Triton kernels run in Triton's interpreter (the tests' CPU kernels)")
XDG_CACHE_HOME = EnvVar("XDG_CACHE_HOME", _text, None, "the user's cache folder (default ~/.cache)")
PYTHONPATH = EnvVar("PYTHONPATH", _text, None, "passed on to TP and Ray workers, after nanovllm's own folder")

# ---- tuning knobs, read once at import (benchmarks/bench_with.py A/Bs them) ---------------------
FOLD_NORMS = EnvVar("NANOVLLM_FOLD_NORMS", _bool, True, "fold RMSNorm weights into the next GEMM at load "
                    "(models/llama.py)", knob=True)
STORE_AT_WARM_UP = EnvVar("NANOVLLM_STORE_AT_WARM_UP", _bool, True, "the warm-up prefill stores K/V "
                          "(compiles the variant later steps run; layers/attention.py)", knob=True)
PARALLEL_COMPILE = EnvVar("NANOVLLM_PARALLEL_COMPILE", _bool, True, "compile the Triton prefill variants "
                          "in threads at start-up (kernels/triton_prefill.py)", knob=True)
PREFILL_TMA = EnvVar("NANOVLLM_PREFILL_TMA", _bool, True, "Triton prefill reads K/V through tensor "
                     "descriptors on compute capability 9+ (kernels/triton_prefill.py)", knob=True)
DECODE_PROGRAMS_PER_SM = EnvVar("NANOVLLM_DECODE_PROGRAMS_PER_SM", _positive_int, 4, "programs per SM "
                                "the decode kernel's split count aims for (kernels/decode_attention.py)",
                                knob=True)
SILU_WHOLE_ROWS = EnvVar("NANOVLLM_SILU_WHOLE_ROWS", _non_negative_int, 2048, "from this many rows, "
                         "scaled SiLU-and-mul runs one program a row (kernels/norm_act.py)", knob=True)
SAMPLING_FAST_LOG = EnvVar("NANOVLLM_SAMPLING_FAST_LOG", _bool, True, "the sampling kernel's logs by the "
                           "hardware approximation (kernels/sampling.py)", knob=True)
PHILOX_ROUNDS = EnvVar("NANOVLLM_PHILOX_ROUNDS", _positive_int, 10, "Philox rounds of the sampling "
                       "kernel's random numbers (kernels/sampling.py; changes the draws)", knob=True)
MOE_ONE_PROGRAM_MAX_PAIRS = EnvVar("NANOVLLM_MOE_ONE_PROGRAM_MAX_PAIRS", _non_negative_int, 4096,
                                   "up to this many (token, expert) pairs are sorted by one program "
                                   "(kernels/moe_routing.py; 0: never)", knob=True)
MOE_SCALE_AFTER_LOOP = EnvVar("NANOVLLM_MOE_SCALE_AFTER_LOOP", _bool, True, "per-channel FP8 experts "
                              "scale their sums once after the K loop (kernels/fused_moe.py)", knob=True)
MOE_PREFILL_BLOCK_K_FP8 = EnvVar("NANOVLLM_MOE_PREFILL_BLOCK_K_FP8", _positive_int, 128, "FP8 experts' "
                                 "prefill K slice (kernels/fused_moe.py)", knob=True)
FP8_BLOCK_GEMM = EnvVar("NANOVLLM_FP8_BLOCK_GEMM", _choice("cublas", "triton"), "cublas", "the GEMM of "
                        "128 x 128 block-scaled FP8 weights (kernels/fp8_gemm.py)", knob=True)
FP8_FAST_ACCUM = EnvVar("NANOVLLM_FP8_FAST_ACCUM", _bool, True, "fast accumulation in the per-channel "
                        "FP8 torch._scaled_mm (kernels/fp8_gemm.py)", knob=True)
FP8_ONE_PASS_MAX = EnvVar("NANOVLLM_FP8_ONE_PASS_MAX", _non_negative_int, 16384, "the longest activation "
                          "group quantized in one pass (kernels/fp8_gemm.py; 0: two passes)", knob=True)
FP8_UNIT_SCALE_MAX_M = EnvVar("NANOVLLM_FP8_UNIT_SCALE_MAX_M", _non_negative_int, 512, "up to this many "
                              "rows the per-channel FP8 GEMM runs per tensor with unit scales "
                              "(kernels/fp8_gemm.py)", knob=True)
FP8_DEFER_SCALES = EnvVar("NANOVLLM_FP8_DEFER_SCALES", _bool, True, "gate/up's FP8 scales applied by "
                          "SiLU-and-mul (kernels/fp8_gemm.py)", knob=True)

VARIABLES: tuple[EnvVar, ...] = tuple(v for v in globals().values() if isinstance(v, EnvVar))


def by_name(name: str) -> EnvVar:
    """The declared variable called `name`; a ValueError naming the closest ones for any other."""
    import difflib
    found = {v.name: v for v in VARIABLES}
    if name in found:
        return found[name]
    close = difflib.get_close_matches(name, found, n=1)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    raise ValueError(f"{name} is not a nanovllm environment variable: {hint}"
                     f"(declared: {', '.join(sorted(found))})")


def environ_with(**changes: str) -> dict[str, str]:
    """This process's environment with `changes`: what a child interpreter (a TP worker) is given,
    so every variable above reaches it as it is here."""
    return {**os.environ, **changes}
