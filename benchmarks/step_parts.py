"""A decode step's GPU time by part, replaying the engine's own CUDA graphs (CUDA only).

For each batch size: the graph's replay with every row padding (the layers' GEMMs, norms and small
kernels, attention launched but with nothing to read or store: the step's cost besides the K/V
traffic), then with bench.py-like contexts (uniform 100-2048 tokens over arbitrary cache blocks,
each new token's K/V written to its slot, as in a real step), and the LM head on its own. Each is
the median of 7 timings of 20 back-to-back replays (CUDA events, after a warm-up). A profile of 5
replays gives the kernels per step and the sum of their durations; replay minus that sum is the
time between kernels (launch gaps and tails), per kernel.

    PYTHONPATH=. python benchmarks/step_parts.py [--model M] [--kv-cache-dtype fp8] [--kernels N]
                                                 [--json PATH]

Each contexts row is followed by the time of the two kernels that touch the K/V cache (the decode
kernel and the q/k norm + rotary + store)."""
import argparse
import collections
import functools
import json
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import DEFAULT_MODEL  # noqa: E402
from bench_kernels import median_ms  # noqa: E402
from nanovllm import LLM  # noqa: E402
from nanovllm.engine.decode_graphs import DecodeInputs, longest_first  # noqa: E402

BATCHES = [256, 128, 64, 32, 16, 8]


def kernels_per_call(fn, calls=5) -> tuple[float, float, dict[str, tuple[float, float]]]:
    """(kernels per call, the sum of their durations in ms per call, {kernel name: (launches, ms) per
    call})."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset"))]
    by_name = collections.defaultdict(lambda: [0.0, 0.0])
    for e in kernels:
        by_name[e.name][0] += 1 / calls
        by_name[e.name][1] += e.device_time / calls / 1e3
    return (len(kernels) / calls, sum(e.device_time for e in kernels) / calls / 1e3,
            {name: tuple(v) for name, v in by_name.items()})


def fill(graphs, bs: int, contexts: list[int] | None, num_blocks: int):
    """Set the static inputs of graph bs: padding rows, or sequences of the given contexts."""
    inputs = DecodeInputs.view(graphs.inputs, bs, graphs.max_blocks)
    inputs.fill_padding()
    if contexts:
        rng, block, n = random.Random(1), graphs.block_size, len(contexts)
        inputs.context_lens[:n] = torch.tensor(contexts, dtype=torch.int32)
        inputs.order[:n] = torch.tensor(longest_first(contexts), dtype=torch.int32)
        inputs.positions[:n] = torch.tensor([c - 1 for c in contexts], dtype=torch.int32)
        tables = [[rng.randrange(num_blocks) for _ in range(graphs.max_blocks)] for _ in contexts]
        inputs.block_tables[:n] = torch.tensor(tables, dtype=torch.int32)
        # the slot of each new token, in its table (two sequences may share a random block: harmless)
        slots = [t[(c - 1) // block] * block + (c - 1) % block for t, c in zip(tables, contexts)]
        inputs.slots[:n] = torch.tensor(slots, dtype=torch.int32)


@torch.inference_mode()   # the graphs' static inputs are inference tensors
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--json")
    p.add_argument("--kernels", type=int, default=0, metavar="N",
                   help="also list the N costliest kernels of each padding replay")
    args = p.parse_args()
    llm = LLM(args.model, load_format="dummy", max_model_len=4096, gpu_memory_utilization=0.5,
              kv_cache_dtype=args.kv_cache_dtype)
    runner = llm.model_runner
    graphs, num_blocks = runner.graphs, runner.kv_cache.shape[2]
    print(f"{args.model}, KV {args.kv_cache_dtype}")
    print(f"{'batch':>5} {'part':>12} {'ms':>8} {'kernels':>8} {'kernel ms':>10} {'gap us/kernel':>14}")
    rows = []
    rng = random.Random(0)
    for bs in BATCHES:
        contexts = [rng.randint(100, 2048) for _ in range(bs)]
        replay, hidden = graphs.replays[bs], graphs.outputs[:bs]
        parts = {"padding": replay, "contexts": replay,
                 "lm_head": functools.partial(runner.model.compute_logits, hidden)}
        for part, fn in parts.items():
            fill(graphs, bs, contexts if part == "contexts" else None, num_blocks)
            ms = median_ms(fn, calls=20, timings=7)
            count, kernel_ms, by_name = kernels_per_call(fn)
            gap = (ms - kernel_ms) * 1e3 / max(count, 1)
            rows.append(dict(batch=bs, part=part, ms=ms, kernels=count, kernel_ms=kernel_ms,
                             by_kernel=by_name))
            print(f"{bs:5d} {part:>12} {ms:8.4f} {count:8.0f} {kernel_ms:10.4f} {gap:14.2f}", flush=True)
            if part == "contexts":   # the two kernels that touch the K/V cache
                for kernel in ("_decode_split_kernel", "_qk_norm_rope_store_kernel"):
                    k_ms = sum(t for name, (_, t) in by_name.items() if kernel in name)
                    print(f"{'':20} {k_ms:8.4f} ms  {kernel}")
            if part == "padding" and args.kernels:
                costliest = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:args.kernels]
                for name, (launches, k_ms) in costliest:
                    print(f"{'':20} {k_ms:8.4f} ms {launches:5.0f}x  {name[:70]}")
    fill(graphs, graphs.sizes[-1], None, num_blocks)
    llm.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, kv_cache_dtype=args.kv_cache_dtype, rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
