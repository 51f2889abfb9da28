"""The decode attention kernel's variants over an FP8 cache, and the bf16 kernel beside them, at
Qwen3-0.6B's shapes (16 query heads, 8 KV heads, head_dim 128, blocks of 256 tokens) on one GPU.

For each case (batch x context: 256 x 1024, 64 x 4096, 16 x 8192, and bench.py's mixed contexts
100-2048 at batches 256 and 32, with the CUDA graphs' 16-block tables) and each variant: the
output's largest error against the fp32 torch reference on the same (dequantized) cache, relative
to the largest output; then the median of 25 timings of 10 back-to-back calls (CUDA events, after a
warm-up), as bytes per second (K and V of every context at 1 byte per value for FP8, 2 for bf16,
plus q and out) and as a fraction of a device-to-device copy measured here. Ends with the FP8
variants ranked by their mean fraction of copy over the cases, and the line that makes the fastest
correct one the default (decode_attention.FP8_DECODE). About 3 minutes on one H200, most of it
compiling.

    PYTHONPATH=. python benchmarks/fp8_decode_sweep.py [--json PATH] [--quick] [--only asm regs168 ...]

--by-batch instead times bench.py's mixed contexts at each batch size its decode graphs replay
(256 down to 8), for a few tile shapes x split counts, each call inside a CUDA graph (an eager call
at a small batch would time its launch), FP8 and bf16, and prints the best per batch size against
the default's: what a per-batch-size choice (graphs are captured per size) could gain.
"""
import argparse
import dataclasses
import json
import statistics
import time

import torch
import triton

from bench_kernels import knobs, launch_order
from bench_timing import graph_ms, median_ms
from nanovllm.kernels import decode_attention
from nanovllm.kernels.decode_attention import Fp8Decode, paged_decode_attention_triton
from nanovllm.kernels.reference import paged_decode_attention_ref, quantize_fp8
from nanovllm.utils import roofline

H, HKV, D, BLOCK = 16, 8, 128, 256
SCALE = D ** -0.5
K_SCALE, V_SCALE = 1 / 64, 1 / 128   # not 1.0, so the scales' folding is checked too
# (batch, context), or ("mixed", batch): bench.py's contexts; its batch shrinks to a few sequences
# at the end of the run, where the split count matters.
CASES = [(256, 1024), (64, 4096), (16, 8192), ("mixed", 256), ("mixed", 32)]
LAUNCH_ORDER = True   # --no-order: batch order
# The largest error allowed, relative to the largest output: a few bf16 roundings (2^-8 each).
MAX_REL_ERR = 2e-2

# The FP8 variants timed, by name. "old default" is the kernel before the V conversion moved:
# Triton's cast, which reads V's dot operand one byte per shared-memory load.
FP8_VARIANTS = {
    "old default 256x8 triton-cvt": Fp8Decode(256, 8, v_convert="triton", mask_last_tile_only=False),
    "128x4 triton-cvt": Fp8Decode(128, 4, v_convert="triton", mask_last_tile_only=False),
    "128x4 asm masked": Fp8Decode(128, 4, mask_last_tile_only=False),
    "128x4 asm": Fp8Decode(128, 4),
    "128x4 asm regs168": Fp8Decode(128, 4, max_registers=168),
    "128x4 asm regs168 st3": Fp8Decode(128, 4, num_stages=3, max_registers=168),
    "128x8 asm": Fp8Decode(128, 8),
    "64x4 asm masked": Fp8Decode(64, 4, mask_last_tile_only=False),
    "64x4 asm": Fp8Decode(64, 4),
    "64x4 asm regs128": Fp8Decode(64, 4, max_registers=128),
    "64x4 asm st3": Fp8Decode(64, 4, num_stages=3),
    "64x4 asm st1": Fp8Decode(64, 4, num_stages=1),   # no prefetch: three programs per SM hide the loads
    "64x2 asm": Fp8Decode(64, 2),
    "32x2 asm": Fp8Decode(32, 2),
    "256x8 asm": Fp8Decode(256, 8),
    # one warp a program: no barrier waits on other warps, more programs per SM
    "32x1 asm": Fp8Decode(32, 1),
    "32x1 asm regs168": Fp8Decode(32, 1, max_registers=168),
    "64x1 asm": Fp8Decode(64, 1),
    "64x1 trans": Fp8Decode(64, 1, transposed=True),
    "32x1 trans": Fp8Decode(32, 1, transposed=True),
    "64x2 trans": Fp8Decode(64, 2, transposed=True),
    "128x4 trans": Fp8Decode(128, 4, transposed=True),
    "128x2 trans": Fp8Decode(128, 2, transposed=True),
    "64x2 asm regs168": Fp8Decode(64, 2, max_registers=168),
    # more warps resident a SM than the one-warp tiles' 6 (decode_sass.py: registers, shared memory)
    "64x4 trans": Fp8Decode(64, 4, transposed=True),                       # 4 programs: 16 warps
    "64x4 trans regs96": Fp8Decode(64, 4, transposed=True, max_registers=96),   # 5: 20 warps
    "128x4 trans st1": Fp8Decode(128, 4, num_stages=1, transposed=True),   # 3: 12 warps
    "128x4 trans st1 regs128": Fp8Decode(128, 4, num_stages=1, transposed=True, max_registers=128),  # 4: 16
    "128x8 trans st1": Fp8Decode(128, 8, num_stages=1, transposed=True),   # 2: 16 warps
}
QUICK = ["old default 256x8 triton-cvt", "128x4 asm regs168", "64x1 asm", "64x1 trans"]
# bf16 variants: (name, module constants); the first is the default.
BF16_VARIANTS = [("bf16 default 128x4", {}),
                 ("bf16 128x4 mask-last-tile", dict(MASK_LAST_TILE_ONLY=True)),
                 ("bf16 64x4", dict(BLOCK_N=64)),
                 ("bf16 128x4 trans", dict(TRANSPOSED=True)),
                 ("bf16 64x4 trans", dict(BLOCK_N=64, TRANSPOSED=True)),
                 ("bf16 64x2 trans", dict(BLOCK_N=64, NUM_WARPS=2, TRANSPOSED=True)),
                 ("bf16 64x1 trans", dict(BLOCK_N=64, NUM_WARPS=1, TRANSPOSED=True))]


@dataclasses.dataclass
class Case:
    name: str
    q: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor
    caches: dict          # "bf16" / "fp8": (k_cache, v_cache, scales kwargs)
    refs: dict            # "bf16" / "fp8": the fp32 reference output

    def nbytes(self, kind):
        per_value = 1 if kind == "fp8" else 2
        return int(self.lens.sum()) * HKV * D * 2 * per_value + 2 * self.q.numel() * 2


def make_case(spec, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if spec[0] == "mixed":   # as bench.py's decode runs: contexts 100-2048, tables 16 blocks wide
        batch, width = spec[1], 16
        name = f"b={batch} mixed ctx 100-2048"
        lens = torch.randint(100, 2049, (batch,), device="cuda", generator=gen, dtype=torch.int32)
    else:
        batch, ctx = spec
        width, name = -(-ctx // BLOCK), f"b={batch} ctx={ctx}"
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    num_blocks = batch * width
    k = torch.randn(num_blocks, BLOCK, HKV, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn(num_blocks, BLOCK, HKV, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    tables = torch.randperm(num_blocks, device="cuda", generator=gen).int().view(batch, width)
    q = torch.randn(batch, H, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    k_scale = torch.tensor([K_SCALE], device="cuda")
    v_scale = torch.tensor([V_SCALE], device="cuda")
    caches = {"bf16": (k, v, {}),
              "fp8": (quantize_fp8(k, k_scale), quantize_fp8(v, v_scale),
                      dict(k_scale=k_scale, v_scale=v_scale))}
    refs = {kind: reference(q, tables, lens, *caches[kind]) for kind in caches}
    return Case(name, q, tables, lens, caches, refs)


def reference(q, tables, lens, k_cache, v_cache, scales, chunk=32):
    """The fp32 torch reference, in batch chunks (its gathered cache would not fit at once)."""
    outs = [paged_decode_attention_ref(q[i:i + chunk].float(), k_cache, v_cache, tables[i:i + chunk],
                                       lens[i:i + chunk], SCALE, scales.get("k_scale"), scales.get("v_scale"))
            for i in range(0, q.shape[0], chunk)]
    return torch.cat(outs)


def run_variant(case, kind, copy_bw, num_splits=None, in_graph=False):
    """Check and time the kernel with the module's current constants ({"error": ...} when it fails);
    in_graph: time it inside a CUDA graph (graph_ms), as the engine runs it."""
    k_cache, v_cache, scales = case.caches[kind]
    # the engine's launch order: the longest contexts first
    order = launch_order(case.lens) if LAUNCH_ORDER else None

    def call():
        return paged_decode_attention_triton(case.q, k_cache, v_cache, case.tables, case.lens, SCALE,
                                             num_splits=num_splits, order=order, **scales)
    try:
        out = call()
        torch.cuda.synchronize()
    except Exception as e:   # a variant that fails to compile (or to run) must not end the sweep
        return dict(error=f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:80]}")
    ref = case.refs[kind]
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    ms = graph_ms(call) if in_graph else median_ms(call)
    bw = case.nbytes(kind) / (ms * 1e-3)
    return dict(ms=ms, bytes_per_s=bw, of_copy=bw / copy_bw, max_rel_err=err, ok=err <= MAX_REL_ERR)


def constructor(config):
    """The Python line that makes `config` the FP8 default."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.name in ("block_n", "num_warps") or getattr(config, f.name) != f.default}
    return "FP8_DECODE = Fp8Decode(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"


def fastest(rows, names):
    """The FP8 variants correct on every case, best first by mean fraction of copy: [(mean, name)]."""
    ranked = []
    for name in names:
        mine = [r for r in rows if r["variant"] == name]
        if mine and all(r.get("ok") for r in mine):
            ranked.append((statistics.mean(r["of_copy"] for r in mine), name))
    return sorted(ranked, reverse=True)


BY_BATCH = [256, 128, 64, 32, 16, 8]
BY_BATCH_TILES = {"fp8": {"64x1": Fp8Decode(64, 1), "64x1 trans": Fp8Decode(64, 1, transposed=True),
                          "32x1 trans": Fp8Decode(32, 1, transposed=True),
                          "128x4 regs168": Fp8Decode(128, 4, max_registers=168),
                          "64x1 st1": Fp8Decode(64, 1, num_stages=1),
                          "64x1 st3": Fp8Decode(64, 1, num_stages=3),
                          "32x1 regs168": Fp8Decode(32, 1, max_registers=168)},
                  "bf16": {"128x4": dict(BLOCK_N=128, NUM_WARPS=4), "64x4": dict(BLOCK_N=64, NUM_WARPS=4)}}
BY_BATCH_SPLITS = [None, 1, 2, 4, 8, 16, 32]   # None: choose_num_splits (the default)


def by_batch(copy_bw, json_path=None):
    rows = []
    for batch in BY_BATCH:
        case = make_case(("mixed", batch))
        for kind, tiles in BY_BATCH_TILES.items():
            results = []
            for tile, config in tiles.items():
                with knobs(decode_attention, **(dict(FP8_DECODE=config) if kind == "fp8" else config)):
                    for splits in BY_BATCH_SPLITS:
                        r = run_variant(case, kind, copy_bw, num_splits=splits, in_graph=True)
                        if "error" in r:
                            print(f"  b={batch} {kind} {tile} splits {splits}: {r['error']}")
                            continue
                        results.append(dict(batch=batch, kind=kind, tile=tile, splits=splits, **r))
            rows += results
            default = next(r for r in results if r["tile"] == next(iter(tiles)) and r["splits"] is None)
            best = max((r for r in results if r["ok"]), key=lambda r: r["of_copy"])
            print(f"b={batch:3d} {kind:4s} default {default['ms'] * 1e3:7.1f} us {default['of_copy']:6.1%}"
                  f"   best {best['tile']:13s} splits {best['splits']!s:>4s} {best['ms'] * 1e3:7.1f} us "
                  f"{best['of_copy']:6.1%}   ({default['ms'] / best['ms']:.2f}x)", flush=True)
        case = None
        torch.cuda.empty_cache()
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(copy_bytes_per_s=copy_bw, by_batch=rows), f, indent=1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help=f"only {QUICK} and the bf16 default")
    parser.add_argument("--only", nargs="+", help="only the FP8 variants whose names contain one of these "
                        "(and bf16)")
    parser.add_argument("--cases", nargs="+",
                        help="instead of the default cases: BxCTX or mixed:B (bench.py's contexts)")
    parser.add_argument("--no-order", action="store_true", help="launch the sequences in batch order, not "
                        "longest context first (the engine's order)")
    parser.add_argument("--graph", action="store_true", help="time each call inside a CUDA graph "
                        "(as the engine runs it; eager calls at small batches time their launch)")
    parser.add_argument("--by-batch", action="store_true", help="tiles x splits per batch size, in graphs")
    args = parser.parse_args()
    t0 = time.perf_counter()
    if args.by_batch:
        return by_batch(roofline.measure_copy_bandwidth(nbytes=2 << 30), args.json)
    fp8_names = QUICK if args.quick else list(FP8_VARIANTS)
    fp8_names = [name for name in fp8_names if args.only is None or any(o in name for o in args.only)]
    bf16_variants = BF16_VARIANTS[:1] if args.quick else BF16_VARIANTS
    copy_bw = roofline.measure_copy_bandwidth(nbytes=2 << 30)
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}; "
          f"device copy {copy_bw / 1e12:.2f} TB/s; FP8 default now: {decode_attention.FP8_DECODE}")
    rows = []
    cases = CASES
    if args.cases:
        cases = [(c.split(":")[0], int(c.split(":")[1])) if ":" in c else tuple(map(int, c.split("x")))
                 for c in args.cases]
    global LAUNCH_ORDER
    LAUNCH_ORDER = not args.no_order
    for spec in cases:
        case = make_case(spec)
        print(f"\n{case.name}   ({case.nbytes('fp8') / 1e6:.0f} MB FP8, "
              f"{case.nbytes('bf16') / 1e6:.0f} MB bf16)")
        print(f"  {'variant':32s} {'ms':>8s} {'GB/s':>7s} {'of copy':>8s} {'rel err':>9s}")
        runs = [(name, "bf16", dict(constants)) for name, constants in bf16_variants]
        runs += [(name, "fp8", dict(FP8_DECODE=FP8_VARIANTS[name])) for name in fp8_names]
        for name, kind, constants in runs:
            with knobs(decode_attention, **constants):
                r = run_variant(case, kind, copy_bw, in_graph=args.graph)
            rows.append(dict(case=case.name, variant=name, kind=kind, **r))
            if "error" in r:
                print(f"  {name:32s} n/a ({r['error']})")
                continue
            flag = "" if r["ok"] else "  WRONG"
            print(f"  {name:32s} {r['ms']:8.4f} {r['bytes_per_s'] / 1e9:7.0f} {r['of_copy']:8.1%} "
                  f"{r['max_rel_err']:9.2e}{flag}")
        del case
        torch.cuda.empty_cache()
    print("\nFP8 variants by mean fraction of copy over the cases (correct on every case):")
    ranked = fastest(rows, fp8_names)
    for name in fp8_names:
        if name not in [n for _, n in ranked]:
            print(f"  {name}: failed or wrong on some case")
    bf16 = {r["case"]: r for r in rows if r["variant"] == BF16_VARIANTS[0][0] and "ms" in r}
    for frac, name in ranked:
        speed = statistics.mean(bf16[r["case"]]["ms"] / r["ms"] for r in rows
                                if r["variant"] == name and r["case"] in bf16)
        print(f"  {frac:6.1%}  {speed:4.2f}x the bf16 default's speed  {name}")
    if bf16:
        print(f"  (bf16 default: {statistics.mean(r['of_copy'] for r in bf16.values()):.1%} of copy)")
    if ranked:
        best = FP8_VARIANTS[ranked[0][1]]
        verdict = "already the default" if best == decode_attention.FP8_DECODE else "NOT the default"
        print(f"\nfastest: {ranked[0][1]} ({verdict}); in nanovllm/kernels/decode_attention.py:\n"
              f"  {constructor(best)}")
    print(f"\n{time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            variants = {name: dataclasses.asdict(c) for name, c in FP8_VARIANTS.items()}
            json.dump(dict(copy_bytes_per_s=copy_bw, variants=variants, results=rows), f, indent=1)


if __name__ == "__main__":
    main()
