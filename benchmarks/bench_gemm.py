"""Decode GEMMs of Qwen3-0.6B on one GPU: does the weight layout change cuBLAS's speed at small batch?

For each projection (K -> N) and batch M: F.linear(x, W) with W [N, K] (how the model stores it) against
x @ Wt with Wt [K, N] contiguous, each in a CUDA graph (median of do_bench_cudagraph), and the sum over
one decode step (28 layers + LM head).

    PYTHONPATH=. python benchmarks/bench_gemm.py
"""
import torch
import torch.nn.functional as F
import triton.testing

LAYERS = 28
SHAPES = {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024),
          "lm_head": (1024, 151936)}


def ms(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def main():
    torch.manual_seed(0)
    print(f"{'M':>4} {'proj':8s} {'linear ms':>10} {'x@Wt ms':>10}")
    for m in (256, 128, 64, 16):
        step = [0.0, 0.0]
        for name, (k, n) in SHAPES.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            wt = w.t().contiguous()
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            a, b = ms(lambda: F.linear(x, w)), ms(lambda: x @ wt)
            times = LAYERS if name != "lm_head" else 1
            step[0] += a * times
            step[1] += b * times
            print(f"{m:4d} {name:8s} {a:10.4f} {b:10.4f}")
        print(f"{m:4d} {'step':8s} {step[0]:10.4f} {step[1]:10.4f}")


if __name__ == "__main__":
    main()
