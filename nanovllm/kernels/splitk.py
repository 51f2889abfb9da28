"""Split-K GEMM for the decode steps' o and down projections (out = x W^T, W: [N, K] row-major).

At decode batch sizes cuBLAS runs these two (N = hidden = 1024 for Qwen3-0.6B) on a grid too
small for the GPU: about 6 us each where reading the weights takes 1-1.5 us. Here the K axis is
cut into `splits` pieces as well, so that there are about PROGRAMS_PER_SM programs per SM; each
leaves an fp32 partial sum, and the add + RMSNorm kernel that follows both projections sums the
partials (in split order: deterministic), rounds them to the activations' dtype as a bf16 GEMM
would, and adds the residual, so no extra launch is needed.

A row's result does not depend on the other rows (the split count and tile depend on N and K
and the row count's bucket only), and it differs from cuBLAS's by the order of the fp32 sum.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.decode_attention import num_sms

MAX_ROWS = 256          # larger token counts (prefill) stay with cuBLAS, which is compute-efficient there
PROGRAMS_PER_SM = 2     # grid size aimed at, in programs per SM
MAX_SPLITS = 8
BLOCK_N = 64
BLOCK_K = 128
ENABLED = True          # a switch for tuning runs and tests


@triton.jit(do_not_specialize=["M"])   # one compiled variant for any row count in a BLOCK_M bucket
def _splitk_kernel(x_ptr, w_ptr, part_ptr, M, N, K, k_per_split,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    # Program (n, m, s): part[s, m-tile, n-tile] = x[m-tile, K-slice s] @ w[n-tile, K-slice s]^T.
    pid_n, pid_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = split * k_per_split
    for k in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        kk = k + ks
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + kk[None, :],
                    mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + kk[None, :],
                    mask=(cols[:, None] < N) & (kk[None, :] < K), other=0.0)
        if UPCAST:   # the interpreter's bf16 dot is wrong (triton 3.9); fp32 gives the same exact products
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc)
    out = part_ptr + (split * M + rows[:, None]).to(tl.int64) * N + cols[None, :]
    tl.store(out, acc, mask=(rows[:, None] < M) & (cols[None, :] < N))


def splitk_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether splitk_partials serves x @ weight^T: an fp16/bf16 decode-sized batch (fp32 would
    multiply in TF32). The caller checks that x is on a GPU."""
    return (ENABLED and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS
            and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype)


def splitk_config(m: int, n: int, k: int, sms: int, block_k: int | None = None) -> tuple[int, int, int]:
    """(BLOCK_M, splits, k_per_split) for an [m, k] x [k, n] product on `sms` SMs. Each split gets
    at least two BLOCK_K steps, and no split is empty."""
    block_k = block_k or BLOCK_K
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    tiles = triton.cdiv(n, BLOCK_N) * triton.cdiv(m, block_m)
    splits = max(1, min(triton.cdiv(PROGRAMS_PER_SM * sms, tiles), k // (2 * block_k), MAX_SPLITS))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    return block_m, triton.cdiv(k, k_per_split), k_per_split


def splitk_partials(x: torch.Tensor, weight: torch.Tensor, block_k: int | None = None,
                    splits: int | None = None) -> torch.Tensor:
    """x: [M, K], weight: [N, K] -> fp32 partial sums [splits, M, N] of x @ weight^T.
    block_k / splits: overrides for tests. Allocates only the output: CUDA-graph safe."""
    block_k = block_k or BLOCK_K
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and x.stride(1) == 1 and weight.is_contiguous()
    x = x if x.stride(0) == k else x.contiguous()
    block_m, num_splits, k_per_split = splitk_config(m, n, k, num_sms(x.device), block_k)
    if splits is not None:
        k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
        num_splits = triton.cdiv(k, k_per_split)
    part = torch.empty(num_splits, m, n, dtype=torch.float32, device=x.device)
    _splitk_kernel[(triton.cdiv(n, BLOCK_N), triton.cdiv(m, block_m), num_splits)](
        x, weight, part, m, n, k, k_per_split, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=block_k,
        UPCAST=not x.is_cuda, num_warps=4, num_stages=3)
    return part
