"""Decode GEMMs of Qwen3-0.6B on one GPU, each in a CUDA graph: cuBLAS for every projection, and for o
and down (N = 1024, each followed by add + RMSNorm) cuBLAS + add_rms_norm against the engine's split-K
kernel whose partials add_rms_norm sums (kernels/splitk.py), at the engine's settings and at the best
of a sweep of PROGRAMS_PER_SM x BLOCK_N x BLOCK_K.

    PYTHONPATH=. python benchmarks/bench_gemm.py
"""
import itertools

import torch
import torch.nn.functional as F
import triton

from nanovllm.kernels import splitk
from nanovllm.kernels.norm_act import add_rms_norm_triton

LAYERS = 28
HIDDEN = 1024
SHAPES = {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024),
          "lm_head": (1024, 151936)}
SWEEP = list(itertools.product((1, 2, 4, 8), (32, 64, 128), (64, 128)))   # PROGRAMS_PER_SM, BLOCK_N, BLOCK_K


def ms(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


def with_settings(per_sm, block_n, block_k, fn):
    saved = splitk.PROGRAMS_PER_SM, splitk.BLOCK_N, splitk.BLOCK_K
    splitk.PROGRAMS_PER_SM, splitk.BLOCK_N, splitk.BLOCK_K = per_sm, block_n, block_k
    try:
        fn()   # compile outside the graph
        return ms(fn)
    finally:
        splitk.PROGRAMS_PER_SM, splitk.BLOCK_N, splitk.BLOCK_K = saved


def main():
    torch.manual_seed(0)
    default = (splitk.PROGRAMS_PER_SM, splitk.BLOCK_N, splitk.BLOCK_K)
    print(f"engine split-K settings (PROGRAMS_PER_SM, BLOCK_N, BLOCK_K) = {default}; times in us")
    print(f"{'M':>4} {'proj':8s} {'cuBLAS':>8} {'+norm':>8} {'splitK+norm':>12} {'best':>8}  best settings, splits")
    norm_w = torch.rand(HIDDEN, device="cuda", dtype=torch.bfloat16) + 0.5
    for m in (256, 192, 128, 64, 32, 16, 1):
        step = [0.0, 0.0, 0.0]
        for name, (k, n) in SHAPES.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            times = LAYERS if name != "lm_head" else 1
            cublas = ms(lambda: F.linear(x, w))
            if n != HIDDEN:
                step = [s + cublas * times for s in step]
                print(f"{m:4d} {name:8s} {cublas * 1e3:8.1f}")
                continue
            residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            plain = ms(lambda: add_rms_norm_triton(F.linear(x, w), residual, norm_w, 1e-6))
            fused = lambda: add_rms_norm_triton(splitk.splitk_partials(x, w), residual, norm_w, 1e-6)  # noqa: E731
            ref = F.linear(x.float(), w.float())
            got = splitk.splitk_partials(x, w).sum(0)
            assert (got - ref).abs().max().item() < 1e-3 * ref.abs().max().item(), name
            engine = with_settings(*default, fused)
            best, best_cfg = min((with_settings(*cfg, fused), cfg) for cfg in SWEEP)
            splits = splitk.splitk_config(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)[1]
            step[0] += plain * times
            step[1] += engine * times
            step[2] += best * times
            print(f"{m:4d} {name:8s} {cublas * 1e3:8.1f} {plain * 1e3:8.1f} {engine * 1e3:12.1f} {best * 1e3:8.1f}"
                  f"  {best_cfg}, engine splits {splits}")
        print(f"{m:4d} {'step':8s} cuBLAS {step[0] * 1e3:.1f} / split-K {step[1] * 1e3:.1f} / best {step[2] * 1e3:.1f}"
              " us (28 layers + LM head, with o/down's add + RMSNorm)")


if __name__ == "__main__":
    main()
