"""y = x W^T with W integer-quantized (W4A16 / W8A16, kernels/wna16_reference.py's packed form) for
decode-sized batches: each program dequantizes a [BLOCK_K, BLOCK_N] tile of W in registers (the
word of each input row shifted and masked, its group's zero point and scale gathered) and multiplies
it with x's tile, so W is read packed, never written out in float. The dequantization is the
reference's (float32 (v - z) * s, rounded once to x's dtype); only the GEMM's summation order differs."""
import torch
import triton
import triton.language as tl

NO_GROUPS = 1 << 30   # a group size past any K: every row in group 0 (one scale per output channel)


@triton.jit
def _wna16_gemm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                       BITS: tl.constexpr, GROUP: tl.constexpr, HAS_G_IDX: tl.constexpr, IEEE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        kn_ok = k_ok[:, None] & n_ok[None, :]
        words = tl.load(q_ptr + (rk[:, None] // PACK) * N + rn[None, :], mask=kn_ok, other=0)
        v = (words >> ((rk[:, None] % PACK) * BITS)) & MASK   # (>> is arithmetic: masked after)
        if HAS_G_IDX:
            g = tl.load(g_ptr + rk, mask=k_ok, other=0)
        else:
            g = rk // GROUP
        s = tl.load(s_ptr + g[:, None] * N + rn[None, :], mask=kn_ok, other=0.0)
        z = tl.load(z_ptr + g[:, None] * N + rn[None, :], mask=kn_ok, other=0)
        w = ((v - z).to(tl.float32) * s).to(x_ptr.dtype.element_ty)   # [BLOCK_K, BLOCK_N]
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def wna16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 g_idx: torch.Tensor | None, bits: int, group: int | None,
                 block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """x [M, K] (16- or 32-bit float); qweight [K / p, N] int32; scales [G, N] float32; zeros [G, N]
    int32; g_idx [K] int32 or None -> y [M, N] in x's dtype."""
    assert x.dim() == 2 and x.stride(1) == 1 and qweight.dtype == torch.int32
    m, k = x.shape
    n = qweight.shape[1]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16   # tl.dot's smallest tile; the decode rows past M are masked
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _wna16_gemm_kernel[grid](x, qweight, scales, zeros, g_idx if g_idx is not None else zeros, y, m, n, k,
                             x.stride(0), y.stride(0), BITS=bits, GROUP=group or NO_GROUPS,
                             HAS_G_IDX=g_idx is not None, IEEE=x.dtype == torch.float32,
                             BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y
