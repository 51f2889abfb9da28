"""Decode GEMMs of Qwen3-0.6B on one GPU: cuBLAS (what the model runs) against a candidate Triton split-K kernel.

cuBLAS takes 19-25 us for a layer's four projections at any batch from 16 to 256 (benchmarks/RESULTS.md),
where reading the layer's 31.5 MB of weights takes 7.3 us: its grids are too small for the N=1024
projections (o, down). The candidate splits K over programs and leaves fp32 partials [split, M, N]; in
the engine their sum, rounding to bf16 and the residual add would go into the add+RMSNorm kernel that
follows o and down, so only the GEMM kernel is timed ("splitK") and, as an upper bound, with a torch
sum after it ("+sum"). Not used by the engine: this file decides whether it is worth building.

    PYTHONPATH=. python benchmarks/bench_gemm.py            # GPU: the table
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/bench_gemm.py --check   # CPU: the kernel's sums
"""
import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

LAYERS = 28
SHAPES = {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024),
          "lm_head": (1024, 151936)}


@triton.jit
def _splitk_kernel(x_ptr, w_ptr, part_ptr, M, N, K, k_per_split,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # part[s, m, n] = sum over k in split s of x[m, k] * w[n, k]; x [M, K], w [N, K] row-major.
    pid_n, pid_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = split * k_per_split
    for k in range(k_start, k_start + k_per_split, BLOCK_K):
        ks = k + offs_k
        x = tl.load(x_ptr + offs_m[:, None] * K + ks[None, :], mask=(offs_m[:, None] < M) & (ks[None, :] < K), other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * K + ks[None, :], mask=(offs_n[:, None] < N) & (ks[None, :] < K), other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    out = part_ptr + split * M * N + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def splitk_partials(x, w, split, block_m, block_n, block_k=128, num_warps=4, num_stages=3):
    m, k = x.shape
    n = w.shape[0]
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    _splitk_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m), split)](
        x, w, part, m, n, k, k_per_split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages)
    return part


def check():
    """Under the interpreter: the partials sum to x @ w.T (fp32), for uneven shapes and splits."""
    torch.manual_seed(0)
    for m, k, n, split in [(5, 300, 40, 1), (17, 300, 40, 3), (16, 256, 64, 4)]:
        x, w = torch.randn(m, k), torch.randn(n, k)
        part = splitk_partials(x, w, split, block_m=16, block_n=16, block_k=32)
        err = (part.sum(0) - x @ w.T).abs().max().item()
        assert err < 1e-3, (m, k, n, split, err)
        print(f"M={m} K={k} N={n} split={split}: {part.shape[0]} partials, max error {err:.2e}")


def ms(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="check the kernel's sums (CPU, TRITON_INTERPRET=1)")
    if parser.parse_args().check:
        return check()
    torch.manual_seed(0)
    configs = [(s, bm, bn) for s in (1, 2, 4, 8) for bm, bn in ((16, 64), (64, 64), (64, 128))]
    print(f"{'M':>4} {'proj':8s} {'cuBLAS':>8} {'best splitK':>12} {'+sum':>8}  (split, BLOCK_M, BLOCK_N); us")
    for m in (256, 128, 64, 16):
        step = [0.0, 0.0]
        for name, (k, n) in SHAPES.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cublas = ms(lambda: F.linear(x, w))
            best, best_cfg = float("inf"), None
            if name != "lm_head":
                for split, bm, bn in configs:
                    if bm > max(16, triton.next_power_of_2(m)):
                        continue
                    t = ms(lambda: splitk_partials(x, w, split, bm, bn))
                    if t < best:
                        best, best_cfg = t, (split, bm, bn)
                ref = F.linear(x, w).float()
                got = splitk_partials(x, w, *best_cfg).sum(0)
                assert (got - ref).abs().max().item() < 0.05 * ref.abs().max().item(), name
                with_sum = ms(lambda: splitk_partials(x, w, *best_cfg).sum(0).to(torch.bfloat16))
            else:
                best, with_sum = cublas, cublas
            times = LAYERS if name != "lm_head" else 1
            step[0] += cublas * times
            step[1] += best * times
            print(f"{m:4d} {name:8s} {cublas * 1e3:8.1f} {best * 1e3:12.1f} {with_sum * 1e3:8.1f}  {best_cfg or ''}")
        print(f"{m:4d} {'step':8s} {step[0] * 1e3:8.1f} {step[1] * 1e3:12.1f}  (28 layers + LM head)")


if __name__ == "__main__":
    main()
