"""Decode GEMMs of Qwen3-0.6B on one GPU, each in a CUDA graph, by BLAS route: torch's default
(cuBLAS), cuBLASLt preferred (torch.backends.cuda.preferred_blas_library), and addmm with a zero bias
(cuBLASLt's GEMM + bias epilogue even under the default).

    PYTHONPATH=. python benchmarks/bench_gemm.py
"""
from functools import partial

import torch
import torch.nn.functional as F
import triton

LAYERS = 28
SHAPES = {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024),
          "lm_head": (1024, 151936)}


def ms(fn, library="cublas"):
    torch.backends.cuda.preferred_blas_library(library)
    try:
        fn()
        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
    finally:
        torch.backends.cuda.preferred_blas_library("cublas")


def main():
    torch.manual_seed(0)
    routes = ("cuBLAS", "cuBLASLt", "+bias")
    print(f"{'M':>4} {'proj':8s}" + "".join(f"{r:>10}" for r in routes) + "  (us; step: 28 layers + LM head)")
    for m in (256, 192, 128, 64, 16, 1):
        step = [0.0] * len(routes)
        for name, (k, n) in SHAPES.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            zero = torch.zeros(n, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, w)
            with_lt = (torch.backends.cuda.preferred_blas_library("cublaslt"), F.linear(x, w))[1]
            torch.backends.cuda.preferred_blas_library("cublas")
            torch.testing.assert_close(with_lt, ref, atol=1e-2, rtol=1e-2)
            times = [ms(partial(F.linear, x, w)), ms(partial(F.linear, x, w), "cublaslt"),
                     ms(partial(F.linear, x, w, zero))]
            reps = LAYERS if name != "lm_head" else 1
            step = [s + t * reps for s, t in zip(step, times)]
            print(f"{m:4d} {name:8s}" + "".join(f"{t * 1e3:10.1f}" for t in times))
        print(f"{m:4d} {'step':8s}" + "".join(f"{s * 1e3:10.1f}" for s in step))


if __name__ == "__main__":
    main()
