"""Where a bench.py run spends its time (CUDA): host time per phase over the whole default workload,
GPU time of each decode step (CUDA events around graph replay + logits + sampling), and a kernel
breakdown of a few eager decode steps at batch 256 (torch.profiler). The host part also runs on
CPU (tests/test_profile_bench.py runs it on a tiny model); the kernel breakdown needs CUDA.
With --tensor-parallel-size N the profile is rank 0's (its host work, and its GPU's kernels,
all-reduces included; the other ranks run the same kernels).
Usage: PYTHONPATH=. python benchmarks/profile_bench.py [--out FILE] [--kv-cache-dtype fp8]
       [--model configs/qwen3-8b] [--tensor-parallel-size 2]"""
import argparse
import gc
import inspect
import os
import statistics
import sys
import time
from collections import Counter, defaultdict
from contextlib import contextmanager

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import DEFAULT_MODEL, workload  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.engine.decode_graphs import DecodeInputs  # noqa: E402
from nanovllm.engine.sampled_tokens import PendingSample  # noqa: E402

# Where the host profile times the engine: (a class, or an attribute path from the LLM; method;
# label). Every one must exist and run during the workload; a refactor that moves one is reported
# by name (see Hooks) instead of leaving its figure empty.
HOST_PHASES = [
    ("scheduler", "schedule", "scheduler.schedule"),
    ("scheduler", "complete", "scheduler.complete (apply tokens, stop checks)"),
    ("model_runner.sampling_prep", "prepare", "sampling_prep.prepare (sampling tensors)"),
    (DecodeInputs, "pack", "DecodeInputs.pack (decode inputs)"),
    ("model_runner", "prepare_prefill", "runner.prepare_prefill (inputs, H2D)"),
    (PendingSample, "result", "tokens to host (waits for the GPU)"),
]


STEP_LABEL = "engine step (run_ahead.step, all of it)"


class HookPointMissing(RuntimeError):
    pass


class Hooks:
    """Wrappers around engine methods for one profile, undone by restore(). A hook point that no
    longer exists raises HookPointMissing at once; one that never ran is named by check_all_ran."""

    def __init__(self, llm):
        self.llm = llm
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self._undo = []

    def target(self, where):
        """The object a hook point names: a class, or an attribute path from the LLM ("" for the LLM)."""
        if not isinstance(where, str):
            return where, where.__name__
        obj = self.llm
        for part in filter(None, where.split(".")):
            if not hasattr(obj, part):
                raise HookPointMissing(f"the engine has no {where} any more (no {part!r} on "
                                       f"{type(obj).__name__}); update the hook points in "
                                       "benchmarks/profile_bench.py")
            obj = getattr(obj, part)
        return obj, where or "LLM"

    def wrap(self, where, name: str, label: str, before=None, after=None):
        """Replace where.name with a version that counts its calls and adds its wall time to label;
        before() runs first, after(result, seconds) last."""
        obj, shown = self.target(where)
        raw = inspect.getattr_static(obj, name, None)
        if raw is None or not callable(getattr(obj, name)):
            raise HookPointMissing(f"{shown}.{name} is gone (the engine was refactored?): find the method "
                                   "that now does this and update the hook points in "
                                   "benchmarks/profile_bench.py")
        original = getattr(obj, name)
        seconds, calls = self.seconds, self.calls

        def timed(*args, **kwargs):
            if before is not None:
                before()
            t = time.perf_counter()
            try:
                out = original(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t
                seconds[label] += dt
                calls[label] += 1
            if after is not None:
                after(out, dt)
            return out
        on_instance = not isinstance(obj, type)
        had_own = on_instance and name in vars(obj)
        setattr(obj, name, staticmethod(timed) if isinstance(raw, staticmethod) else timed)
        self._undo.append((obj, name, raw if (had_own or not on_instance) else None))

    def restore(self):
        for obj, name, raw in reversed(self._undo):
            if raw is None:
                delattr(obj, name)   # the instance attribute shadowed its class's method
            else:
                setattr(obj, name, raw)
        self._undo.clear()

    def check_all_ran(self, labels: list[str]):
        idle = [label for label in labels if not self.calls[label]]
        if idle:
            raise HookPointMissing(f"never called during the run: {', '.join(idle)}; the engine no "
                                   "longer takes this path, so update the hook points in "
                                   "benchmarks/profile_bench.py")


@contextmanager
def hooked(llm):
    hooks = Hooks(llm)
    try:
        yield hooks
    finally:
        hooks.restore()


def host_profile(llm, lines: list[str], prompts, params):
    """Host wall time per phase over one generate of the workload, the decode steps' wall time and,
    on CUDA, their device time (events from the decode forward's launch to the sampler's end)."""
    cuda = torch.cuda.is_available() and llm.model_runner.use_cuda
    step_wall, device_steps, open_step = [], [], []

    def decode_started():
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            open_step[:] = [start]

    def sampled(out, seconds):
        if open_step:   # a decode step's sampling (prefill samples too: no open step then)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            device_steps.append((open_step.pop(), end))

    def stepped(out, seconds):
        _, batch = out   # (finished sequences, the batch launched)
        if batch.seqs and not batch.is_prefill:
            step_wall.append(seconds)
        hooks.seconds["prefill steps" if batch.is_prefill else "decode steps"] += seconds

    with hooked(llm) as hooks:
        for where, name, label in HOST_PHASES:
            hooks.wrap(where, name, label)
        hooks.wrap("model_runner", "run_decode", "runner.run_decode (decode forward launch)",
                   before=decode_started)
        hooks.wrap("model_runner.sampler", "sample", "sampler.sample (launch)", after=sampled)
        hooks.wrap("run_ahead", "step", STEP_LABEL, after=stepped)
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        total = time.perf_counter() - t
        hooks.check_all_ran([label for _, _, label in HOST_PHASES] + [STEP_LABEL])
        if not step_wall:
            raise HookPointMissing("no decode step was seen: the engine's step no longer returns "
                                   "(finished, batch); update stepped() in benchmarks/profile_bench.py")
    if cuda:
        torch.cuda.synchronize()
    tokens = sum(p.max_tokens for p in params)
    lines.append(f"whole run: {total:.2f} s, {tokens / total:.0f} tok/s, {len(step_wall)} decode steps")
    line = (f"decode steps: wall {sum(step_wall):.2f} s (median {statistics.median(step_wall) * 1e3:.2f} ms "
            f"per step)")
    if device_steps:
        gpu = [s.elapsed_time(e) / 1000 for s, e in device_steps]
        line += (f", GPU replay+logits+sample {sum(gpu):.2f} s "
                 f"(median {statistics.median(gpu) * 1e3:.2f} ms per step)")
    lines.append(line)
    lines.append(f"{'phase (host wall time, whole run)':58s} {'s':>8s} {'share':>7s}")
    for label, s in sorted(hooks.seconds.items(), key=lambda kv: -kv[1]):
        lines.append(f"{label:58s} {s:8.3f} {s / total:7.1%}")
    return dict(total_s=total, decode_steps=len(step_wall), step_wall_s=step_wall,
                device_step_s=[s.elapsed_time(e) / 1000 for s, e in device_steps])


def kernel_profile(model, lines, steps=5, gpu_memory_utilization=0.4, kv_cache_dtype="auto",
                   tensor_parallel_size=1):
    llm = LLM(model, load_format="dummy", max_model_len=4096, enforce_eager=True,
              gpu_memory_utilization=gpu_memory_utilization, kv_cache_dtype=kv_cache_dtype,
              tensor_parallel_size=tensor_parallel_size)
    prompts, _ = workload(256, 1024, 1024, 0.6)
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=steps + 3)
    runner = llm.model_runner
    for prompt in prompts:
        llm.add_request(prompt, params)
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        prefills = 0
        while llm.step()[1].is_prefill:   # the prefills (and, launched behind them, one decode step)
            prefills += 1
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    title = f"kernels of the {prefills} prefill steps (+1 decode), wall {wall * 1e3:.0f} ms"
    kernel_table(prof, lines, title, 1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.step()
        torch.cuda.synchronize()
    while not llm.is_finished():
        llm.step()
    kernel_table(prof, lines, f"kernels of {steps} eager decode steps at batch 256", steps)
    del runner
    llm.shutdown()


def kernel_table(prof, lines, title, steps):
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events)
    lines.append(f"\n{title} (GPU time {total / steps / 1e3:.2f} ms per step)")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:18]:
        lines.append(f"{e.key[:70]:70s} {e.self_device_time_total / steps / 1e3:7.3f} ms "
                     f"{e.self_device_time_total / total:6.1%}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--out")
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--skip-host", action="store_true", help="only the kernel breakdown")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4,
                   help="of each engine (one at a time; a model over 0.4 of the GPU needs more)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="as bench.py's: fp8 profiles the engine over an e4m3 KV cache")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per engine (rank 0 is profiled)")
    args = p.parse_args()
    lines = [f"model {args.model}, KV cache {args.kv_cache_dtype}, TP={args.tensor_parallel_size}"]
    if not args.skip_host:
        llm = LLM(args.model, load_format="dummy", max_model_len=4096,
                  gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_dtype=args.kv_cache_dtype,
                  tensor_parallel_size=args.tensor_parallel_size)
        lines.append("start-up: " + ", ".join(f"{k} {v:.1f} s" for k, v in
                                              llm.model_runner.startup_seconds.items()))
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)
        host_profile(llm, lines, *workload(256, 1024, 1024, 0.6))
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    if not args.skip_kernels and not torch.cuda.is_available():
        lines.append("kernel breakdown skipped: it needs CUDA (torch.profiler's CUDA activity)")
    elif not args.skip_kernels:
        kernel_profile(args.model, lines, gpu_memory_utilization=args.gpu_memory_utilization,
                       kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=args.tensor_parallel_size)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
