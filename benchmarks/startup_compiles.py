"""Where LLM(...) start-up goes (CUDA): its phases, and every Triton compile in them, per kernel
(variants, seconds, and which argument's specialisation tells the variants apart) and per phase
(the warm-up prefill, each captured decode batch size). --triton-cache DIR runs with that Triton
cache folder: an empty one compiles every variant from scratch (a fresh machine's first process);
the same folder again shows the warm cost. Same engine options as bench.py.

    PYTHONPATH=. python benchmarks/startup_compiles.py [--kv-cache-dtype fp8] [--triton-cache DIR]
        [--set NAME=VALUE ...] [--first-generate N]
"""
import argparse
import json
import os
import re
import sys
import time
from collections import defaultdict


AFTER_START = ("first generate", "repeated prompts")   # --first-generate's phases


def parse_args():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", help="model folder (default: bench.py's, Qwen3-0.6B shapes)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"])
    p.add_argument("--triton-cache", help="TRITON_CACHE_DIR for this run (set before Triton loads)")
    p.add_argument("--max-num-seqs", type=int, help="engine's max_num_seqs (default: the engine's)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="set a knob of nanovllm/envs.py first, as bench_with.py does (e.g. "
                        "NANOVLLM_PARALLEL_COMPILE=0; with it on, the default, "
                        "compiles overlap, and the per-compile seconds add up to more than the phase's)")
    p.add_argument("--first-generate", type=int, default=0, metavar="N",
                   help="then generate bench.py's workload of N prompts (64 tokens each, twice: the second "
                        "run repeats the prompts, prefix-cache hits): what compiles on a cold process's "
                        "first requests, after start-up")
    p.add_argument("--json", help="write the figures here")
    return p.parse_args()


class CompileLog:
    """Every JITFunction._do_compile call (a variant this process had not compiled: built from
    scratch, or read from the disk cache) with its kernel, cache key, seconds and phase."""

    def __init__(self):
        self.phase = "load"
        self.records: list[tuple[str, str, float, str]] = []

    def install(self):
        from triton.runtime.jit import JITFunction
        original, log = JITFunction._do_compile, self

        def timed(fn, key, *args, **kwargs):
            t = time.perf_counter()
            try:
                return original(fn, key, *args, **kwargs)
            finally:
                name = getattr(fn, "__name__", None) or fn.fn.__name__
                log.records.append((name, str(key), time.perf_counter() - t, log.phase))
        JITFunction._do_compile = timed

    def by_kernel(self) -> dict[str, list[tuple[str, float]]]:
        kernels = defaultdict(list)
        for name, key, seconds, _ in self.records:
            kernels[name].append((key, seconds))
        return kernels

    def by_phase(self) -> dict[str, tuple[int, float]]:
        phases = {}
        for _, _, seconds, phase in self.records:
            n, s = phases.get(phase, (0, 0.0))
            phases[phase] = (n + 1, s + seconds)
        return phases


def differing_args(keys: list[str], arg_names: list[str] | None) -> list[str]:
    """The specialisation entries (one per kernel argument, in order, at the start of a Triton
    cache key) that differ between a kernel's variants, named where the count matches."""
    entries = [re.split(r"\),\s*\(", key.split("]")[0]) for key in keys]
    if len({len(e) for e in entries}) != 1:
        return ["(keys of different lengths)"]
    out = []
    for i, values in enumerate(zip(*entries)):
        if len(set(values)) > 1:
            name = arg_names[i] if arg_names and len(arg_names) == len(entries[0]) else f"argument {i}"
            shown = sorted({v.strip("[( )") for v in values})
            out.append(f"{name}: {' | '.join(shown)}")
    return out


def kernel_arg_names() -> dict[str, list[str]]:
    """name -> argument names of every @triton.jit kernel in nanovllm.kernels."""
    import importlib
    import pkgutil

    import nanovllm.kernels as kernels
    from triton.runtime.jit import JITFunction
    names = {}
    for info in pkgutil.iter_modules(kernels.__path__):
        try:
            module = importlib.import_module(f"nanovllm.kernels.{info.name}")
        except ImportError:   # an optional back end (FA4) that is not installed
            continue
        for value in vars(module).values():
            if isinstance(value, JITFunction):
                names[value.fn.__name__] = list(value.arg_names)
    return names


def main():
    args = parse_args()
    if args.triton_cache:
        os.makedirs(args.triton_cache, exist_ok=True)
        os.environ["TRITON_CACHE_DIR"] = args.triton_cache   # before Triton reads it
    from bench_with import set_knobs
    set_knobs(args.set)   # before nanovllm is imported: its modules read them then
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench import DEFAULT_MODEL, workload
    from nanovllm import SamplingParams
    from nanovllm import LLM
    from nanovllm.engine import decode_graphs, model_runner

    log = CompileLog()
    log.install()
    capture_seconds = {}
    original_warmup = model_runner.ModelRunner.warmup_model
    original_capture = decode_graphs.DecodeGraphs._capture

    def warmup(self, *a, **k):
        log.phase = "warm-up"
        try:
            return original_warmup(self, *a, **k)
        finally:
            log.phase = "after warm-up"

    def capture(self, forward, bs, *a, **k):
        log.phase = f"capture bs={bs}"
        t = time.perf_counter()
        try:
            return original_capture(self, forward, bs, *a, **k)
        finally:
            capture_seconds[bs] = time.perf_counter() - t
            log.phase = "after capture"
    model_runner.ModelRunner.warmup_model = warmup
    decode_graphs.DecodeGraphs._capture = capture

    options = dict(max_num_seqs=args.max_num_seqs) if args.max_num_seqs else {}
    t = time.perf_counter()
    llm = LLM(args.model or DEFAULT_MODEL, load_format="dummy", max_model_len=4096,
              kv_cache_dtype=args.kv_cache_dtype, **options)
    startup = time.perf_counter() - t
    phases = llm.model_runner.startup_seconds
    if args.first_generate:
        prompts, _ = workload(args.first_generate, 1024, 100, 0.6)
        params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=64)
        for run in AFTER_START:
            log.phase = run
            llm.generate(prompts, params, use_tqdm=False)
    at_start = [s for _, _, s, p in log.records if p not in AFTER_START]
    print(f"KV cache {args.kv_cache_dtype}, Triton cache {args.triton_cache or 'default'}: start-up "
          f"{startup:.1f} s ({', '.join(f'{k} {v:.2f} s' for k, v in phases.items())}); "
          f"{len(at_start)} Triton compiles/loads, {sum(at_start):.2f} s")
    arg_names = kernel_arg_names()
    print(f"{'kernel':34s} {'variants':>8s} {'seconds':>8s}  what tells the variants apart")
    kernels = sorted(log.by_kernel().items(), key=lambda kv: -sum(s for _, s in kv[1]))
    for name, variants in kernels:
        diff = differing_args([k for k, _ in variants], arg_names.get(name)) if len(variants) > 1 else []
        print(f"{name:34s} {len(variants):8d} {sum(s for _, s in variants):8.2f}  {'; '.join(diff)[:150]}")
    print(f"{'phase':34s} {'compiles':>8s} {'seconds':>8s} {'phase s':>8s}")
    for phase, (n, s) in log.by_phase().items():
        bs = phase.removeprefix("capture bs=")
        wall = f"{capture_seconds[int(bs)]:8.2f}" if bs.isdigit() else ""
        print(f"{phase:34s} {n:8d} {s:8.2f} {wall}")
    captured = sum(capture_seconds.values())
    in_capture = sum(s for *_, s, p in log.records if p.startswith("capture"))
    print(f"{len(capture_seconds)} graphs captured in {captured:.2f} s, {captured - in_capture:.2f} s of it "
          "outside Triton compiles")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(kv_cache_dtype=args.kv_cache_dtype, triton_cache=args.triton_cache,
                           startup_s=startup, phases_s=phases, capture_s=capture_seconds,
                           compiles=[dict(kernel=n, seconds=s, phase=p) for n, _, s, p in log.records],
                           variants={n: len(v) for n, v in kernels}), f, indent=1)
    llm.shutdown()


if __name__ == "__main__":
    main()
