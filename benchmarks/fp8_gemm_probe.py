"""Where the per-channel FP8 GEMMs lose time (issue 45): Qwen3-8B's four layer GEMMs at decode and
prefill token counts, each variant timed alone in CUDA graphs (bench_timing.graph_ms), in µs:

    bf16        F.linear on bf16 weights (the baseline)
    rw_fast     torch._scaled_mm, row-wise scales, use_fast_accum=True (fp8_linear's call)
    rw_exact    the same, use_fast_accum=False
    tensor      torch._scaled_mm, one float32 scale per operand, use_fast_accum=True (vLLM's online FP8)
    triton      fp8_gemm.fp8_gemm, per channel (the fp16/fp32 path)
    quant       fp8_gemm.quantize_activations alone (the per-token quantization before each GEMM)
    fp8_linear  quantization + rw GEMM, as the model runs a layer without fused quantization

then for the fastest FP8 GEMM (of the four): its weight bytes per second and FLOP/s; after each
token count the sum over the four GEMMs (a layer's GEMM time; x 36 layers for the model's). A
variant that fails prints its error and shows "-".

    PYTHONPATH=. python benchmarks/fp8_gemm_probe.py [--ms 1,8,256]
"""
import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_timing import graph_ms  # noqa: E402
from nanovllm.kernels import fp8_gemm as fp8_kernels  # noqa: E402
from nanovllm.kernels.fp8_gemm import fp8_gemm, fp8_linear, quantize_activations  # noqa: E402
from nanovllm.kernels.fp8_reference import quantize_weight  # noqa: E402

GEMMS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096)}  # K, N
MS = [1, 8, 16, 32, 64, 128, 192, 256, 512, 16384]
VARIANTS = ["bf16", "rw_fast", "rw_exact", "tensor", "triton", "quant", "fp8_linear"]
FP8_GEMMS = ["rw_fast", "rw_exact", "tensor", "triton"]
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
    }


def time_us(name: str, fn, what: str) -> float:
    try:
        return graph_ms(fn, timings=15) * 1e3
    except Exception as e:   # one failure must not stop the rest
        print(f"  {what} {name}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:150]}", flush=True)
        return math.nan


def fmt(us: float) -> str:
    return f"{us:11.1f}" if not math.isnan(us) else f"{'-':>11s}"


def row(label: str, m: int, times: dict, weight_bytes: int, flops: int) -> str:
    fp8 = {k: times[k] for k in FP8_GEMMS if not math.isnan(times[k])}
    best = min(fp8, key=fp8.get) if fp8 else None
    tail = (f"  {best:>8s} {weight_bytes / fp8[best] / 1e6:6.2f} {flops / fp8[best] / 1e6:8.1f}" if best
            else f"  {'-':>8s}")
    return f"{label:8s} {m:6d}" + "".join(fmt(times[k]) for k in VARIANTS) + tail


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ms", default=",".join(map(str, MS)), help="token counts, comma-separated")
    ms = [int(m) for m in p.parse_args().ms.split(",")]
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
          f"{torch.cuda.get_device_name()}; fp8_linear's use_fast_accum: {fp8_kernels.FAST_ACCUM}",
          flush=True)
    torch.manual_seed(0)
    weights = {}
    for name, (k, n) in GEMMS.items():
        w = (torch.randn(n, k, device=DEVICE) * 0.02).to(torch.bfloat16)
        weights[name] = (w, *quantize_weight(w, None))
    print(f"{'gemm':8s} {'M':>6s}" + "".join(f"{v:>11s}" for v in VARIANTS)
          + f"  {'best fp8':>8s} {'TB/s':>6s} {'TFLOP/s':>8s}   (µs; TB/s: FP8 weight bytes / best)")
    for m in ms:
        total = dict.fromkeys(VARIANTS, 0.0)
        total_bytes = total_flops = 0
        for name, (k, n) in GEMMS.items():
            x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
            fns = variants(*weights[name], x)
            times = {v: time_us(v, fns[v], f"{name} M={m}") for v in VARIANTS}
            print(row(name, m, times, n * k, 2 * m * n * k), flush=True)
            for v in VARIANTS:
                total[v] += times[v]
            total_bytes, total_flops = total_bytes + n * k, total_flops + 2 * m * n * k
            del x, fns
        print(row("sum", m, total, total_bytes, total_flops), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
