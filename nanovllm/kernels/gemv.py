"""Skinny GEMMs for decode at a handful of rows: y = x W^T (+ C), x [M, K] with M <= GEMV_MAX_M,
W [N, K] (nn.Linear's layout, rows contiguous along K). At these M a GEMM is a stream of W through
the SMs: each program owns BLOCK_N output features and walks all of K, BLOCK_K at a time, the loads
pipelined num_stages deep, so no split-K partials and no reduce kernel. "dot": the M rows padded to
16 into tensor-core tiles; "fma": products summed on the CUDA cores (fp32, one partial per lane,
reduced once at the end). The sweep (`benchmarks/bench_kernels.py --gemv`) picks mode and tile per shape.

Not yet measured on a GPU: CONFIGS is empty, so every GEMM stays cuBLAS's until a sweep fills it. The
case for it (docs/benchmarks.md, "One stream"): at batch 1 on the 8B shapes cuBLAS streams gate_up at
the copy bandwidth but qkv, o and down (split-K plus a reduce kernel) below it, 0.39 ms a step in all.

Numerics: fp32 accumulation of the products, then + C in fp32, rounded once to the output dtype, as
cuBLAS's addmm (beta 1) does; the order of the fp32 sum differs from cuBLAS's.
"""
import torch
import triton
import triton.language as tl

GEMV_MAX_M = 4   # the rows a step may have for these kernels (decode at batch 1-4)


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(x_ptr, w_ptr, c_ptr, out_ptr, M, N, K, x_stride, c_stride, out_stride,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
                 HAS_C: tl.constexpr, EVEN_K: tl.constexpr):
    # x: [M, K], w: [N, K], c/out: [M, N]; this program: output columns n0 .. n0 + BLOCK_N
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_K)
    n_ok, m_ok = n < N, m < M
    w_rows = w_ptr + n.to(tl.int64)[:, None] * K
    x_rows = x_ptr + m[:, None] * x_stride
    if DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        if EVEN_K:
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None], other=0.0)
            x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0.0)
        else:
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & (kk < K)[None, :], other=0.0)
            x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)
        if DOT:
            acc = tl.dot(x, tl.trans(w), acc)
        else:
            acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    if not DOT:
        acc = tl.sum(acc, axis=2)
    mask = m_ok[:, None] & n_ok[None, :]
    if HAS_C:
        acc += tl.load(c_ptr + m[:, None] * c_stride + n[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m[:, None] * out_stride + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


# (mode, BLOCK_N, BLOCK_K, num_warps, num_stages); CONFIGS comes from `benchmarks/bench_kernels.py --gemv`.
DEFAULT_CONFIG = ("dot", 32, 256, 4, 4)
# (N, K, M) -> config for the weight shapes and row counts where the sweep found these kernels faster
# than cuBLAS; any other GEMM keeps cuBLAS.
CONFIGS: dict[tuple[int, int, int], tuple] = {}


def gemv_config(x: torch.Tensor, w: torch.Tensor):
    """The config to run x W^T with (CUDA, at most GEMV_MAX_M rows, a swept shape), or None: cuBLAS."""
    if not x.is_cuda or x.dim() != 2 or x.shape[0] > GEMV_MAX_M or x.stride(1) != 1:
        return None
    return CONFIGS.get((*w.shape, x.shape[0]))


def gemv(x: torch.Tensor, w: torch.Tensor, into: torch.Tensor | None = None, config=None) -> torch.Tensor:
    """x [M, K] (M <= GEMV_MAX_M) times w [N, K]^T -> [M, N] in x's dtype; into ([M, N]): the
    product added to it, in place, and returned (a GEMM's C with beta 1)."""
    M, K = x.shape
    N = w.shape[0]
    assert M <= GEMV_MAX_M and w.shape[1] == K and w.stride(1) == 1 and x.stride(1) == 1
    mode, block_n, block_k, warps, stages = config or DEFAULT_CONFIG
    out = into if into is not None else torch.empty(M, N, dtype=x.dtype, device=x.device)
    c = into if into is not None else out
    dot = mode == "dot"
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, w, c, out, M, N, K, x.stride(0), c.stride(0), out.stride(0),
        BLOCK_M=16 if dot else triton.next_power_of_2(M), BLOCK_N=block_n, BLOCK_K=block_k, DOT=dot,
        HAS_C=into is not None, EVEN_K=K % block_k == 0, num_warps=warps, num_stages=stages)
    return out
