"""Where the per-channel FP8 GEMMs lose time (issue 45): Qwen3-8B's four layer GEMMs at decode and
prefill token counts, each variant timed alone in CUDA graphs (bench_kernels.graph_ms), in µs:

    bf16        F.linear on bf16 weights (the baseline)
    rw_fast     torch._scaled_mm, row-wise scales, use_fast_accum=True (fp8_linear's call)
    rw_exact    the same, use_fast_accum=False
    tensor      torch._scaled_mm, one float32 scale per operand, use_fast_accum=True (vLLM's online FP8)
    triton      fp8_gemm.fp8_gemm, per channel (the fp16/fp32 path)
    quant       fp8_gemm.quantize_activations alone (the per-token quantization before each GEMM)
    fp8_linear  quantization + rw GEMM, as the model runs a layer without fused quantization
    unit        tensor's GEMM (unit scales) + fp8_gemm.scale_out (the rows' and channels' scales after)
    unit_lin    fp8_linear with fp8_gemm.UNIT_SCALE_MAX_M above M (quantization + unit)

then for the fastest FP8 GEMM (of the four): its weight bytes per second and FLOP/s; after each
token count the sum over the four GEMMs (a layer's GEMM time; x 36 layers for the model's). A
variant that fails prints its error and shows "-".

--block: the same with Qwen3-8B-FP8's format (128 x 128 weight blocks, 1 x 128 activation groups):

    blk_cublas  torch._scaled_mm with block scales (fp8_gemm.BLOCK_GEMM = "cublas")
    blk_triton  fp8_gemm.fp8_gemm with the block scales, its default tiles
    quant       quantize_activations in groups of 128 (m_major for cuBLASLt's layout)
    fp8_linear  quantization + the block GEMM BLOCK_GEMM names

--sweep (with --block): each GEMM and token count also times the Triton block kernel under the
tiles in SWEEP_TILES that suit it (BLOCK_M up to twice M; 64 or more from M = 1,024) and prints the
fastest three.

    PYTHONPATH=. python benchmarks/fp8_gemm_probe.py [--ms 1,8,256] [--block [--sweep]]
"""
import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_kernels import graph_ms  # noqa: E402
from nanovllm.kernels import fp8_gemm as fp8_kernels  # noqa: E402
from nanovllm.kernels.fp8_gemm import fp8_gemm, fp8_linear, quantize_activations  # noqa: E402
from nanovllm.kernels.fp8_reference import quantize_weight  # noqa: E402

GEMMS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096)}  # K, N
MS = [1, 8, 16, 32, 64, 128, 192, 256, 512, 16384]
VARIANTS = ["bf16", "rw_fast", "rw_exact", "tensor", "triton", "quant", "fp8_linear", "unit", "unit_lin"]
FP8_GEMMS = ["rw_fast", "rw_exact", "tensor", "triton"]
BLOCK_VARIANTS = ["bf16", "blk_cublas", "blk_triton", "quant", "fp8_linear"]
BLOCK_FP8_GEMMS = ["blk_cublas", "blk_triton"]
BLOCK = (128, 128)
# (BLOCK_M, BLOCK_N, num_warps, num_stages) for --sweep
SWEEP_TILES = [(16, 32, 4, 4), (16, 64, 4, 4), (16, 64, 4, 5), (16, 128, 4, 4), (32, 32, 4, 5),
               (32, 64, 4, 4), (32, 128, 4, 4), (64, 32, 4, 4), (64, 64, 4, 4), (64, 128, 4, 4),
               (64, 128, 4, 3), (64, 256, 8, 3), (128, 64, 4, 4), (128, 128, 8, 3), (128, 128, 8, 4),
               (128, 128, 4, 3), (128, 256, 8, 3), (256, 128, 8, 3)]
DEVICE = "cuda"


def variants(w: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, x: torch.Tensor) -> dict:
    """name -> a call taking no arguments, for weights w (bf16 [N, K]), wq / ws (FP8, [N, 1] scales)
    and activations x (bf16 [M, K])."""
    xq, xs = quantize_activations(x, x.shape[1])
    one = torch.ones((), device=DEVICE, dtype=torch.float32)   # per-tensor scales (value irrelevant)
    bf16 = torch.bfloat16

    def rowwise(fast):
        return lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=bf16,
                                        use_fast_accum=fast)
    return {
        "bf16": lambda: F.linear(x, w),
        "rw_fast": rowwise(True),
        "rw_exact": rowwise(False),
        "tensor": lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=bf16,
                                           use_fast_accum=True),
        "triton": lambda: fp8_gemm(xq, xs, wq, ws, None, bf16),
        "quant": lambda: quantize_activations(x, x.shape[1]),
        "fp8_linear": lambda: fp8_linear(x, wq, ws, None),
        "unit": lambda: fp8_kernels.scale_out(fp8_kernels._unit_scaled_mm(xq, wq), xs, ws.view(-1), None),
        "unit_lin": lambda: unit_linear(x, wq, ws),
    }


def unit_linear(x, wq, ws):
    saved, fp8_kernels.UNIT_SCALE_MAX_M = fp8_kernels.UNIT_SCALE_MAX_M, 1 << 30
    try:
        return fp8_linear(x, wq, ws, None)
    finally:
        fp8_kernels.UNIT_SCALE_MAX_M = saved


def block_variants(w: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, x: torch.Tensor) -> dict:
    """The same for 128 x 128 block scales ws [N / 128, K / 128]."""
    xq, xs = quantize_activations(x, BLOCK[1])
    xq_t, xs_t = quantize_activations(x, BLOCK[1], m_major=True)
    return {
        "bf16": lambda: F.linear(x, w),
        "blk_cublas": lambda: torch._scaled_mm(xq_t, wq.t(), scale_a=xs_t, scale_b=ws.t(),
                                               out_dtype=torch.bfloat16),
        "blk_triton": lambda: fp8_gemm(xq, xs, wq, ws, BLOCK, torch.bfloat16),
        "quant": lambda: quantize_activations(x, BLOCK[1], m_major=fp8_kernels.BLOCK_GEMM == "cublas"),
        "fp8_linear": lambda: fp8_linear(x, wq, ws, BLOCK),
        "_sweep": lambda tile: (lambda: fp8_gemm(xq, xs, wq, ws, BLOCK, torch.bfloat16, tiles=dict(
            BLOCK_M=tile[0], BLOCK_N=tile[1], num_warps=tile[2], num_stages=tile[3]))),
    }


def time_us(name: str, fn, what: str) -> float:
    try:
        return graph_ms(fn, timings=15) * 1e3
    except Exception as e:   # one failure must not stop the rest
        print(f"  {what} {name}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:150]}", flush=True)
        return math.nan


def fmt(us: float) -> str:
    return f"{us:11.1f}" if not math.isnan(us) else f"{'-':>11s}"


def row(label: str, m: int, times: dict, weight_bytes: int, flops: int, names: list, gemms: list) -> str:
    fp8 = {k: times[k] for k in gemms if not math.isnan(times[k])}
    best = min(fp8, key=fp8.get) if fp8 else None
    tail = (f"  {best:>10s} {weight_bytes / fp8[best] / 1e6:6.2f} {flops / fp8[best] / 1e6:8.1f}" if best
            else f"  {'-':>10s}")
    return f"{label:8s} {m:6d}" + "".join(fmt(times[k]) for k in names) + tail


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ms", default=",".join(map(str, MS)), help="token counts, comma-separated")
    p.add_argument("--block", action="store_true", help="128 x 128 weight blocks (Qwen3-8B-FP8's format)")
    p.add_argument("--sweep", action="store_true", help="with --block: time the Triton kernel's tiles")
    args = p.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    names, gemms = (BLOCK_VARIANTS, BLOCK_FP8_GEMMS) if args.block else (VARIANTS, FP8_GEMMS)
    make = block_variants if args.block else variants
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
          f"{torch.cuda.get_device_name()}; fp8_linear's use_fast_accum: {fp8_kernels.FAST_ACCUM}",
          flush=True)
    torch.manual_seed(0)
    weights = {}
    for name, (k, n) in GEMMS.items():
        w = (torch.randn(n, k, device=DEVICE) * 0.02).to(torch.bfloat16)
        weights[name] = (w, *quantize_weight(w, BLOCK if args.block else None))
    print(f"{'gemm':8s} {'M':>6s}" + "".join(f"{v:>11s}" for v in names)
          + f"  {'best fp8':>10s} {'TB/s':>6s} {'TFLOP/s':>8s}   (µs; TB/s: FP8 weight bytes / best)")
    for m in ms:
        total = dict.fromkeys(names, 0.0)
        total_bytes = total_flops = 0
        for name, (k, n) in GEMMS.items():
            x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
            fns = make(*weights[name], x)
            times = {v: time_us(v, fns[v], f"{name} M={m}") for v in names}
            print(row(name, m, times, n * k, 2 * m * n * k, names, gemms), flush=True)
            if args.sweep:
                tiles = [t for t in SWEEP_TILES if t[0] <= max(16, 2 * m) and (m < 1024 or t[0] >= 64)]
                swept = sorted(((time_us(str(t), fns["_sweep"](t), f"{name} M={m}"), t) for t in tiles),
                               key=lambda p: math.inf if math.isnan(p[0]) else p[0])
                print("    sweep: " + ", ".join(f"{t} {us:.1f}" for us, t in swept[:3]
                                                if not math.isnan(us)), flush=True)
            for v in names:
                total[v] += times[v]
            total_bytes, total_flops = total_bytes + n * k, total_flops + 2 * m * n * k
            del x, fns
        print(row("sum", m, total, total_bytes, total_flops, names, gemms), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
