"""Does splitting a decode step into two micro-batches on two CUDA streams pay (CUDA only)?

The decode step's GEMMs and small kernels are bound by latency (grids far smaller than 132 SMs),
attention by bandwidth. Two halves of the batch recorded into one CUDA graph on two streams have no
dependency on each other, so the GPU may run one half's GEMMs while the other half's attention
streams the KV cache. This replays, per batch size with bench.py-like contexts (100-2048 tokens):
  one       the engine's own graph (the whole batch on one stream)
  serial    the two halves one after the other on one stream (the cost of splitting)
  two       the two halves on two streams
  two-prio  the same, the second stream at high priority
Each figure is the median of 7 timings of 20 back-to-back replays (CUDA events, after warm-up),
and every variant's hidden states are checked against the engine graph's.

    PYTHONPATH=. python benchmarks/overlap_probe.py [--model M] [--kv-cache-dtype fp8]
"""
import argparse
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import DEFAULT_MODEL  # noqa: E402
from bench_timing import median_ms  # noqa: E402
from step_parts import fill  # noqa: E402
from nanovllm import LLM  # noqa: E402
from nanovllm.engine.decode_graphs import DecodeInputs  # noqa: E402

BATCHES = [256, 192, 128, 96, 64, 32]


def capture_halves(runner, graphs, bs: int, streams: int, priority: int = 0):
    """A graph of the batch as two halves: on one stream after another, or on two."""
    inputs = DecodeInputs.view(graphs.inputs, bs, graphs.max_blocks)
    split = bs // 2
    halves = [DecodeInputs(*(t[:split] for t in inputs)), DecodeInputs(*(t[split:] for t in inputs))]
    # each half launches its rows in its own order (the batch's order holds rows of both halves)
    halves = [h._replace(order=torch.arange(h.order.numel(), dtype=h.order.dtype, device=h.order.device))
              for h in halves]
    out = torch.empty(bs, graphs.outputs.size(1), dtype=graphs.outputs.dtype, device=graphs.outputs.device)
    side = torch.cuda.Stream(priority=priority)

    def step():
        main = torch.cuda.current_stream()
        if streams == 2:
            side.wait_stream(main)   # the fork: the side stream starts with the step
        out[:split].copy_(runner.decode_forward(halves[0]))
        with torch.cuda.stream(side if streams == 2 else main):
            out[split:].copy_(runner.decode_forward(halves[1]))
        if streams == 2:
            main.wait_stream(side)   # the join

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, graphs._pool):
        step()
    torch.cuda.synchronize()
    return graph.replay, out


@torch.inference_mode()
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--batches", type=int, nargs="*", default=BATCHES)
    args = p.parse_args()
    llm = LLM(args.model, load_format="dummy", max_model_len=4096, gpu_memory_utilization=0.5,
              kv_cache_dtype=args.kv_cache_dtype)
    runner = llm.model_runner
    graphs, num_blocks = runner.graphs, runner.kv_cache.shape[2]
    low, high = torch.cuda.Stream.priority_range()
    print(f"{args.model}, KV {args.kv_cache_dtype}; stream priorities {low}..{high}")
    print(f"{'batch':>5} {'one ms':>8} {'serial':>8} {'two':>8} {'two-prio':>9} {'best/one':>9} "
          f"{'max diff':>9}")
    rng = random.Random(0)
    for bs in args.batches:
        if bs not in graphs.replays:
            continue
        contexts = [rng.randint(100, 2048) for _ in range(bs)]
        fill(graphs, bs, contexts, num_blocks)
        one = graphs.replays[bs]
        one()
        torch.cuda.synchronize()
        ref = graphs.outputs[:bs].clone()
        times, diff = {"one": median_ms(one, calls=20, timings=7)}, 0.0
        for name, streams, prio in (("serial", 1, 0), ("two", 2, 0), ("two-prio", 2, high)):
            replay, out = capture_halves(runner, graphs, bs, streams, prio)
            replay()
            torch.cuda.synchronize()
            diff = max(diff, (out.float() - ref.float()).abs().max().item())
            times[name] = median_ms(replay, calls=20, timings=7)
        best = min(times["two"], times["two-prio"])
        print(f"{bs:5d} {times['one']:8.4f} {times['serial']:8.4f} {times['two']:8.4f} "
              f"{times['two-prio']:9.4f} {best / times['one']:9.3f} {diff:9.2e}", flush=True)
    fill(graphs, graphs.sizes[-1], None, num_blocks)
    llm.shutdown()


if __name__ == "__main__":
    main()
