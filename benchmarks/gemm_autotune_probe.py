"""Can Triton GEMMs beat cuBLAS at the decode GEMMs' shapes? Asks torch's own autotuner (Inductor,
max-autotune, its Triton GEMM templates only, persistent TMA ones included) for the best Triton
kernel of each of Qwen3-0.6B's four decode GEMMs at a few batch sizes, then times it against cuBLAS
the way a decode step runs them: one call per layer over 28 distinct weight sets, in one CUDA graph
(weights cold in L2), us a layer. o_proj and down_proj add the residual (addmm for cuBLAS, the add
in the template's epilogue for Inductor). Outputs are checked against cuBLAS. Inductor's ranking of
the configs it tried goes to stderr ("AUTOTUNE ..."). Only a probe: the engine does not use it.

    PYTHONPATH=. python benchmarks/gemm_autotune_probe.py [--batches 256 128 64 16]
                                                          [--gemms qkv o gate_up down]
"""
import argparse
import sys
import time

import torch
import torch._inductor.config as inductor_config

from bench_timing import graph_ms

LAYERS = 28
# name: (K, N, residual added)
GEMMS = {"qkv": (1024, 4096, False), "o": (2048, 1024, True), "gate_up": (1024, 6144, False),
         "down": (3072, 1024, True)}


def plain(x, w):
    return x @ w.t()


def with_residual(x, w, r):
    return r + x @ w.t()


def probe(name: str, weights: list[torch.Tensor], m: int, residual: bool) -> str:
    """One GEMM at batch m: Inductor's Triton choice against cuBLAS, a line of the table."""
    n, k = weights[0].shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    extra = (torch.randn(m, n, device="cuda", dtype=torch.bfloat16),) if residual else ()
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    start = time.perf_counter()
    with inductor_config.patch(max_autotune=True, max_autotune_gemm_backends="TRITON",
                               **{"triton.enable_persistent_tma_matmul": True}):
        compiled = torch.compile(with_residual if residual else plain, dynamic=False)
        print(f"AUTOTUNE {name} M={m}", file=sys.stderr, flush=True)
        got = compiled(x, weights[0], *extra)
    tune_s = time.perf_counter() - start
    want = torch.addmm(extra[0], x, weights[0].t()) if residual else x @ weights[0].t()
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()

    def cublas_all():
        for w in weights:
            if residual:
                torch.addmm(extra[0], x, w.t(), out=out)
            else:
                torch.mm(x, w.t(), out=out)

    def triton_all():
        for w in weights:
            compiled(x, w, *extra)

    cublas_us = graph_ms(cublas_all, calls=1, timings=20) * 1e3 / LAYERS
    triton_us = graph_ms(triton_all, calls=1, timings=20) * 1e3 / LAYERS
    return (f"{name:>8} {m:>4} {cublas_us:>10.2f} {triton_us:>10.2f} {triton_us / cublas_us:>6.2f} "
            f"{err:>8.1e} {tune_s:>7.1f}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 128, 64, 16])
    parser.add_argument("--gemms", nargs="+", default=list(GEMMS), choices=list(GEMMS))
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"{'gemm':>8} {'M':>4} {'cuBLAS us':>10} {'Triton us':>10} {'ratio':>6} {'max err':>8} "
          f"{'tune s':>7}", flush=True)
    for name in args.gemms:
        k, n, residual = GEMMS[name]
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(LAYERS)]
        for m in args.batches:
            print(probe(name, weights, m, residual), flush=True)


if __name__ == "__main__":
    main()
