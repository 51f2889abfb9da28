"""The fused MoE kernels at Qwen3-30B-A3B shapes (128 experts, top 8, hidden 2048, expert
intermediate 768, bf16) on one GPU: time per layer for decode batches and prefill steps, the share of
the touched experts' weight bytes at copy bandwidth (decode) or TFLOP/s (prefill), the parts of one
call (router, sort, gate/up, down, sum), and a sweep of tile configs for each regime.

    python benchmarks/moe_sweep.py [--inter 768] [--fp8 channel|block] [--quick] [--json out.json]

--inter 384 gives one rank's shard under TP=2. --fp8 quantizes the experts per output channel (what
quantization="fp8" does at load) or in Qwen3-30B-A3B-FP8's 128 x 128 blocks, and the kernels quantize
the activations as the engine does (the byte figures then count one byte a weight; the prefill grid
adds 128-wide K slices). Reads nothing from the engine; the best tiles per regime are printed as the
knobs of nanovllm/kernels/fused_moe.py to set."""
import argparse
import functools
import itertools
import json

import torch
import triton.testing

from nanovllm.kernels import fused_moe as fm
from nanovllm.kernels import moe_routing
from nanovllm.kernels.fp8_reference import quantize_weight
from nanovllm.kernels.moe_reference import select_experts
from nanovllm.utils import roofline

E, K, H = 128, 8, 2048
DEVICE = "cuda"
DECODE_BATCHES, PREFILL_TOKENS = (1, 8, 32, 64, 128, 256, 512), (1024, 4096, 16384)
SCALES = None          # (w13_scale, w2_scale, block) with --fp8: fused_moe_triton's scales
WEIGHT_BYTES = 2


def case(num_tokens: int, inter: int, weights=None):
    gen = torch.Generator(device=DEVICE).manual_seed(num_tokens)
    if weights is None:
        weights = ((torch.randn(E, 2 * inter, H, device=DEVICE, generator=gen) * 0.02).bfloat16(),
                   (torch.randn(E, H, inter, device=DEVICE, generator=gen) * 0.02).bfloat16())
    x = torch.randn(num_tokens, H, device=DEVICE, generator=gen).bfloat16()
    router = (torch.randn(E, H, device=DEVICE, generator=gen) * 0.02).bfloat16()
    topk_weights, ids = select_experts(x @ router.T, K, renormalize=True)
    return weights, x, router, topk_weights, ids


def ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=30)


def figures(num_tokens, inter, weights, x, topk_weights, ids, tiles=None) -> tuple[float, str]:
    """(ms per call, achieved: % of copy bandwidth over the touched experts' weights, or TFLOP/s)."""
    t = ms(lambda: fm.fused_moe_triton(x, *weights, topk_weights, ids, tiles, scales=SCALES))
    touched = torch.unique(ids).numel()
    if num_tokens <= 512:
        bytes_ = touched * 3 * H * inter * WEIGHT_BYTES + num_tokens * H * 2 * 2
        return t, f"{100 * bytes_ / t / 1e9 / COPY_TBS:5.1f}%"
    flops = num_tokens * K * 3 * H * inter * 2
    return t, f"{flops / t / 1e9:6.0f}TF"


def parts(num_tokens, inter, weights, x, router, topk_weights, ids) -> str:
    tiles = fm.choose_tiles(num_tokens * K, E, fm.fp8_group_of(SCALES, H, inter))
    w13, w2 = weights
    route = ms(lambda: moe_routing.select_experts_triton(x @ router.T, K, True))
    sort = ms(lambda: moe_routing.align_by_expert(ids, E, tiles.block_m))
    total = ms(lambda: fm.fused_moe_triton(x, w13, w2, topk_weights, ids, scales=SCALES))
    y = torch.empty(num_tokens, K, H, dtype=x.dtype, device=x.device)
    summed = ms(lambda: y.sum(dim=1))
    return (f"gate+route {route * 1e3:6.1f}us  sort {sort * 1e3:6.1f}us  sum {summed * 1e3:6.1f}us  "
            f"gemms {max(total - sort - summed, 0) * 1e3:7.1f}us  (fused_moe_triton {total * 1e3:7.1f}us)")


DECODE_GRID = dict(block_m=(16, 32), block_n=(32, 64, 128), block_k=(64, 128, 256), num_warps=(4,),
                   num_stages=(2, 3, 4))
PREFILL_GRID = dict(block_m=(64, 128), block_n=(64, 128), block_k=(32, 64), num_warps=(4, 8),
                    num_stages=(3, 4))
QUICK = dict(decode=dict(block_m=(16, 32), block_n=(64, 128), block_k=(128,), num_warps=(4,),
                         num_stages=(2, 3)),
             prefill=dict(block_m=(64, 128), block_n=(128,), block_k=(64,), num_warps=(4, 8),
                          num_stages=(3,)))


def sweep(regime: str, sizes, grid: dict, inter: int, weights) -> dict:
    configs = [fm.Tiles(*v) for v in itertools.product(*grid.values())]
    cases = {n: case(n, inter, weights)[1:] for n in sizes}
    times = {}
    for tiles in configs:
        try:
            times[tiles] = [ms(functools.partial(fm.fused_moe_triton, x, *weights, w, ids, tiles,
                                                 scales=SCALES))
                            for x, _, w, ids in cases.values()]
        except Exception as e:   # e.g. out of shared memory
            print(f"  {tiles}: {type(e).__name__}")
    default = fm.choose_tiles(sizes[-1] * K, E, fm.fp8_group_of(SCALES, H, inter))
    best = min(times, key=lambda t: sum(times[t]))
    sizes_shown = ", ".join(map(str, sizes))
    print(f"{regime} sweep over {len(times)} tile configs, ms per call at {sizes_shown} tokens:")
    for tiles in sorted(times, key=lambda t: sum(times[t]))[:5] + ([default] if default in times else []):
        tag = "  (default)" if tiles == default else ""
        print(f"  BM {tiles.block_m:3d} BN {tiles.block_n:3d} BK {tiles.block_k:3d} warps {tiles.num_warps} "
              f"stages {tiles.num_stages}: " + "  ".join(f"{t:.4f}" for t in times[tiles]) + tag)
    prefix = regime.upper()
    print(f"  knobs: {prefix}_BLOCK_M, _BLOCK_N, _BLOCK_K, _WARPS, _STAGES = {best.block_m}, {best.block_n}, "
          f"{best.block_k}, {best.num_warps}, {best.num_stages}")
    return dict(best=best.__dict__, default=default.__dict__,
                times={str(t.__dict__): v for t, v in times.items()})


def main():
    global COPY_TBS, SCALES, WEIGHT_BYTES
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--fp8", choices=["channel", "block"], help="FP8 experts, scaled per channel or per block")
    p.add_argument("--quick", action="store_true", help="a smaller sweep grid")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--json")
    args = p.parse_args()
    COPY_TBS = roofline.measure_copy_bandwidth(DEVICE) / 1e12
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    print(f"{device}: copy {COPY_TBS:.2f} TB/s; E={E} top-{K} hidden {H} inter {args.inter}")
    weights = case(1, args.inter)[0]
    grids = QUICK if args.quick else dict(decode=DECODE_GRID, prefill=PREFILL_GRID)
    if args.fp8:
        block = (128, 128) if args.fp8 == "block" else None
        (w13, s13), (w2, s2) = (quantize_weight(w, block) for w in weights)
        weights, SCALES, WEIGHT_BYTES = (w13, w2), (s13, s2, block), 1
        grids = {regime: dict(grid, block_k=tuple(sorted(set(grid["block_k"]) | {128})) if regime == "prefill"
                              else grid["block_k"]) for regime, grid in grids.items()}
        print(f"FP8 experts, scales per {args.fp8}")
    record = dict(copy_tbs=COPY_TBS, inter=args.inter, fp8=args.fp8, rows=[])
    print("tokens  tiles(BM,BN,BK,w,s)    ms/layer  achieved   parts")
    for n in DECODE_BATCHES + PREFILL_TOKENS:
        _, x, router, w, ids = case(n, args.inter, weights)
        t, achieved = figures(n, args.inter, weights, x, w, ids)
        tiles = fm.choose_tiles(n * K, E, fm.fp8_group_of(SCALES, H, args.inter))
        shown = f"{tiles.block_m},{tiles.block_n},{tiles.block_k},{tiles.num_warps},{tiles.num_stages}"
        split = parts(n, args.inter, weights, x, router, w, ids)
        print(f"{n:6d}  {shown:<20}  {t:8.4f}  {achieved}   {split}")
        record["rows"].append(dict(tokens=n, ms=t, achieved=achieved.strip()))
    if not args.no_sweep:
        record["decode"] = sweep("decode", (8, 64, 256), grids["decode"], args.inter, weights)
        record["prefill"] = sweep("prefill", (4096, 16384), grids["prefill"], args.inter, weights)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
