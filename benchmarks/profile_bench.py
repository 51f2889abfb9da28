"""Where a bench.py run spends its time (CUDA): host time per phase over the whole default workload,
GPU time of each decode step (CUDA events around graph replay + logits + sampling), and a kernel
breakdown of a few eager decode steps at batch 256 (torch.profiler).
Usage: PYTHONPATH=. python benchmarks/profile_bench.py [--out FILE] [--kv-cache-dtype fp8]"""
import argparse
import gc
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import DEFAULT_MODEL, workload  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.engine import model_runner as mr  # noqa: E402
from nanovllm.engine.decode_graphs import DecodeInputs  # noqa: E402


def wrap(obj, name, label, timers):
    original = getattr(obj, name)

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            timers[label] += time.perf_counter() - t
    setattr(obj, name, timed)


def host_profile(llm, lines):
    timers, gpu_ms, step_wall = defaultdict(float), [], []
    runner, sched = llm.model_runner, llm.scheduler
    for obj, name, label in [(sched, "schedule", "scheduler.schedule"),
                             (sched, "complete", "scheduler.complete (apply tokens, stop checks)"),
                             (runner.sampler, "prepare", "sampler.prepare (sampling tensors)"),
                             (DecodeInputs, "pack", "DecodeInputs.pack (decode inputs)"),
                             (runner, "prepare_prefill", "runner.prepare_prefill (inputs, H2D)"),
                             (mr.PendingSample, "result", "tokens to host (waits for the GPU)")]:
        wrap(obj, name, label, timers)
    original_decode = runner.run_decode

    def run_decode(*args):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = original_decode(*args)
        runner._pending = (start, end)
        return out
    runner.run_decode = run_decode
    original_sampler = runner.sampler.sample

    def sampler(*args):
        out = original_sampler(*args)
        if getattr(runner, "_pending", None):
            runner._pending[1].record()
            gpu_ms.append(runner._pending)
            runner._pending = None
        return out
    runner.sampler.sample = sampler
    original_step = llm.step

    def step():
        t = time.perf_counter()
        out = original_step()
        if not out[1].is_prefill:
            step_wall.append(time.perf_counter() - t)
        timers["prefill steps" if out[1].is_prefill else "decode steps"] += time.perf_counter() - t
        return out
    llm.step = step
    prompts, params = workload(256, 1024, 1024, 0.6)
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    total = time.perf_counter() - t
    torch.cuda.synchronize()
    gpu = [s.elapsed_time(e) / 1000 for s, e in gpu_ms]
    tokens = sum(p.max_tokens for p in params)
    lines.append(f"whole run: {total:.2f} s, {tokens / total:.0f} tok/s, {len(step_wall)} decode steps")
    lines.append(f"decode steps: wall {sum(step_wall):.2f} s "
                 f"(median {statistics.median(step_wall) * 1e3:.2f} ms), "
                 f"GPU replay+logits+sample {sum(gpu):.2f} s (median {statistics.median(gpu) * 1e3:.2f} ms)")
    lines.append(f"{'phase (host wall time, whole run)':58s} {'s':>8s} {'share':>7s}")
    for label, s in sorted(timers.items(), key=lambda kv: -kv[1]):
        lines.append(f"{label:58s} {s:8.3f} {s / total:7.1%}")


def kernel_profile(model, lines, steps=5, gpu_memory_utilization=0.4, kv_cache_dtype="auto"):
    llm = LLM(model, load_format="dummy", max_model_len=4096, enforce_eager=True,
              gpu_memory_utilization=gpu_memory_utilization, kv_cache_dtype=kv_cache_dtype)
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
    args = p.parse_args()
    lines = [f"model {args.model}, KV cache {args.kv_cache_dtype}"]
    if not args.skip_host:
        llm = LLM(args.model, load_format="dummy", max_model_len=4096,
                  gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_dtype=args.kv_cache_dtype)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)
        host_profile(llm, lines)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    if not args.skip_kernels:
        kernel_profile(args.model, lines, gpu_memory_utilization=args.gpu_memory_utilization,
                       kv_cache_dtype=args.kv_cache_dtype)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
