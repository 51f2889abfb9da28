"""FP8 GEMMs on the GPU: y = x W^T with W float8_e4m3fn and its dequantization scales (block
[bn, bk] or one per output channel), x quantized at run time (kernels/fp8_reference.py is the oracle).

    quantize kernel   x [M, K] -> x_fp8 [M, K], scale [M, K / group]: per token and group of `group`
                      columns (the weight block's bk; per channel: the whole row), scale = amax / 448
                      (amax taken as at most scale_ub: fbgemm_fp8's activation_scale_ub)
    block format      torch._scaled_mm with 1x128 x 128x128 block scales (cuBLASLt, Hopper, bf16);
                      else the Triton GEMM below
    per channel       bf16 output: up to UNIT_SCALE_MAX_M rows torch._scaled_mm per tensor with unit
                      scales, then scale_out (x_scale[m] * w_scale[n], bias, residual add) or the
                      caller (fp8_linear_unscaled: SiLU-and-mul); above it torch._scaled_mm with
                      row-wise scales (cuBLASLt). Else the Triton GEMM with one group spanning K
    Triton GEMM       acc += (x_fp8 tile . W_fp8 tile) * x_scale[m, g] * w_scale[n / bn, g] for each
                      BLOCK_K = bk slice g (FP8 tensor cores, fp32 accumulation); one rounding at the end

Divisions are round-to-nearest (div_rn) and the FP8 cast rounds to nearest, so the quantized
activations are the reference's bit for bit. Nothing reads a value on the host: CUDA-graph safe.
"""
import functools
import math

import torch
import triton
import triton.language as tl

import nanovllm.envs as envs
from nanovllm.kernels.common import rounded

FP8_MAX = tl.constexpr(448.0)   # a constexpr: the kernels read it
# The block format's GEMM: "cublas", torch._scaled_mm with 1x128 activation and 128x128 weight
# scales (cuBLASLt 12.9+ on Hopper; bf16 outputs, K a multiple of 512 and N of 128, as the tested
# shapes are; else Triton), or "triton" (below). cuBLASLt's is 1.2-2.1x faster from 128 rows up,
# and level below (H100, benchmarks/fp8_gemm_probe.py --block). NANOVLLM_FP8_BLOCK_GEMM
# (envs.py), so bench_with.py can compare both.
BLOCK_GEMM = envs.FP8_BLOCK_GEMM.get()
# Fast accumulation for the per-channel torch._scaled_mm: the FP8 products summed in the tensor
# cores' accumulator throughout, not promoted to fp32 registers every few k-steps (vLLM's CUTLASS
# FP8 GEMMs on Hopper do the same). NANOVLLM_FP8_FAST_ACCUM (envs.py), so bench_with.py can compare both.
FAST_ACCUM = envs.FP8_FAST_ACCUM.get()
# The longest activation group quantized in one pass (loaded once, kept in registers: 16,384 columns
# are 32 a thread in 16 warps); a longer one is read twice in slices of up to 1,024 columns (0: every
# group, the kernel as it was before, for A/Bs).
ONE_PASS_MAX = envs.FP8_ONE_PASS_MAX.get()
# Groups shorter than this (the block format's 128 columns) go several to a program, up to this
# many columns in all: one program of 1 x 128 each was launch-bound (318 us for 16,384 x 4,096 on an
# H100, where the bytes take 45). 1: a program a group, for A/Bs.
GROUP_TILE = 4096
# Per-channel GEMMs of up to this many rows run cuBLASLt's per-tensor FP8 GEMM with unit scales, then
# _scale_out_kernel applies the rows' and channels' scales (and the bias, and the residual add) to its
# bf16 output: at decode sizes cuBLASLt's row-wise GEMM reads an 8B layer's weights at 1.3-2.6 TB/s,
# its per-tensor one at 2.9-3.7 (benchmarks/fp8_gemm_probe.py). On the 8B shapes with FP8 weights and
# an FP8 cache (H100): 0 (row-wise at every size) 11,638 tok/s, 128 11,904, 192 12,070, 512 12,079.
UNIT_SCALE_MAX_M = envs.FP8_UNIT_SCALE_MAX_M.get()
# On that path, fp8_linear_unscaled leaves the scales to its caller: the MLP's gate/up GEMM hands them
# to SiLU-and-mul, which applies them as it loads gate and up (one pass over the output fewer).
# False: fp8_linear_unscaled applies them itself, as fp8_linear does (for A/Bs). The outputs are the
# same bit for bit; the 8B shapes with an FP8 cache (H100, one call) 12,126 / 12,146 tok/s on against
# 11,999 off, with a bf16 cache 9,768 against 9,742.
DEFER_SCALES = envs.FP8_DEFER_SCALES.get()
# Under the interpreter (tests on CPU) tl.dot on FP8 is not emulated: the tiles go through fp32.
_DOT_F32 = envs.TRITON_INTERPRET.get()


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, K, x_stride, s_stride_m, s_stride_g, ub,
                     GROUP: tl.constexpr, BLOCK: tl.constexpr, GROUPS: tl.constexpr, ONE_PASS: tl.constexpr):
    # program (row, c): x[row, groups c*GROUPS .. (c+1)*GROUPS - 1 of GROUP columns] -> q, s[row, g].
    # ONE_PASS (a group fits one BLOCK): a [GROUPS, BLOCK] tile loaded once and kept in registers;
    # else GROUPS is 1 and the group is read twice, BLOCK columns at a time (its amax, then its values).
    # ub: the largest amax a scale is taken from (fbgemm_fp8's activation_scale_ub; else inf).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if ONE_PASS:
        # (names of their own: the compiler types the two-pass loop's variables across both branches)
        gs = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        tile = gs[:, None] * GROUP + cols[None, :]
        in_tile = (cols[None, :] < GROUP) & (tile < K)
        vt = tl.load(x_ptr + row * x_stride + tile, mask=in_tile, other=0.0).to(tl.float32)
        scales = tl.maximum(tl.div_rn(tl.minimum(tl.max(tl.abs(vt), axis=1), ub), FP8_MAX), 1e-12)
        tl.store(s_ptr + row * s_stride_m + gs * s_stride_g, scales, mask=gs * GROUP < K)
        qt = tl.clamp(tl.div_rn(vt, scales[:, None]), -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * K + tile, qt.to(q_ptr.dtype.element_ty), mask=in_tile)
        return
    g = tl.program_id(1)
    start = g * GROUP
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, GROUP, BLOCK):
        idx = start + c0 + cols
        ok = (c0 + cols < GROUP) & (idx < K)
        v = tl.load(x_ptr + row * x_stride + idx, mask=ok, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.maximum(tl.div_rn(tl.minimum(tl.max(amax, axis=0), ub), FP8_MAX), 1e-12)
    tl.store(s_ptr + row * s_stride_m + g * s_stride_g, scale)
    for c0 in range(0, GROUP, BLOCK):
        idx = start + c0 + cols
        ok = (c0 + cols < GROUP) & (idx < K)
        v = tl.load(x_ptr + row * x_stride + idx, mask=ok, other=0.0).to(tl.float32)
        q = tl.clamp(tl.div_rn(v, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * K + idx, q.to(q_ptr.dtype.element_ty), mask=ok)


def quantize_activations(x: torch.Tensor, group: int, m_major: bool = False, rows: int | None = None,
                         scale_ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] (last dim contiguous) -> (x_fp8 [rows, K], scale float32 [rows, ceil(K / group)]; m_major:
    stored transposed, stride (1, rows), as cuBLASLt's 1x128 block scales are). rows (default M): more
    rows than x has are left unwritten (cuBLASLt's block-scaled GEMM needs a multiple of 4). scale_ub:
    an amax above it counts as scale_ub, the values past it saturate (fbgemm_fp8's activation_scale_ub)."""
    m, k = x.shape
    rows = m if rows is None else rows
    assert rows >= m
    num_groups = triton.cdiv(k, group)
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    if m_major:
        s = torch.empty(num_groups, rows, dtype=torch.float32, device=x.device).t()
    else:
        s = torch.empty(rows, num_groups, dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(group)
        if block <= ONE_PASS_MAX:   # a program takes up to GROUP_TILE columns' worth of whole groups
            groups = min(triton.next_power_of_2(num_groups), max(1, GROUP_TILE // block))
            one_pass, warps = True, min(16, max(1, groups * block // 256))
        else:   # two passes, as before ONE_PASS_MAX (0 restores them for every group)
            block, groups = min(block, 1024), 1
            one_pass, warps = False, 4 if block >= 512 else 1
        ub = math.inf if scale_ub is None else float(scale_ub)
        _quantize_kernel[(m, triton.cdiv(num_groups, groups))](
            x, q, s, k, x.stride(0), s.stride(0), s.stride(1), ub,
            GROUP=group, BLOCK=block, GROUPS=groups,
            ONE_PASS=one_pass, num_warps=warps)
    return q, s


@triton.jit
def _gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, as_stride, bs_stride,
                 GROUP_K: tl.constexpr, SCALE_N: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    # c[m, n] = sum over k slices of (a[m, k] . b[n, k]) * as[m, k / GROUP_K] * bs[n / SCALE_N, k / GROUP_K]
    # a: [M, K], b: [N, K] (both FP8, contiguous); BLOCK_K divides GROUP_K, so a slice has one scale.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * K + rk[None, :]
    b_ptrs = b_ptr + rn.to(tl.int64)[None, :] * K + rk[:, None]   # [BLOCK_K, BLOCK_N]
    as_ptrs = as_ptr + rm.to(tl.int64) * as_stride
    bs_ptrs = bs_ptr + (rn // SCALE_N) * bs_stride
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = rk < K - k0
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        g = k0 // GROUP_K
        sa = tl.load(as_ptrs + g, mask=m_ok, other=0.0)
        sb = tl.load(bs_ptrs + g, mask=n_ok, other=0.0)
        if DOT_F32:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, b)
        acc += part * sa[:, None] * sb[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _tiles(m: int) -> dict:
    """Tiles as a function of the token count only (a captured graph and its replays agree): the
    fastest in most of the 8B's four GEMMs under benchmarks/fp8_gemm_probe.py --block --sweep (H100,
    2026-12-06). Decode reads each weight tile once and is bound by the weight bytes: narrow tiles,
    so that even o_proj (N 4,096) spreads over more than one program per SM."""
    if m <= 16:
        return dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=4)
    if m <= 128:
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4)
    if m <= 256:
        return dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4)


def fp8_gemm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
             block: tuple[int, int] | None, out_dtype: torch.dtype,
             tiles: dict | None = None) -> torch.Tensor:
    """xq [M, K] FP8, xs [M, groups] float32 (quantize_activations), w [N, K] FP8, w_scale
    [ceil(N/bn), ceil(K/bk)] or [N, 1] -> [M, N] in out_dtype, by the Triton kernel (tiles: _tiles'
    keys, for benchmarks/fp8_gemm_probe.py's sweep)."""
    m, k = xq.shape
    n = w.shape[0]
    assert xq.is_contiguous() and w.is_contiguous() and xs.stride(1) == 1
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    if block is None:   # one group spans K: every slice has the same (row, channel) scales
        group_k, scale_n, block_k = k, 1, 64
    else:
        (scale_n, group_k), block_k = block, min(block[1], 128)
        if group_k % block_k or block_k < 16:
            raise ValueError(f"weight block {block}: the kernel needs a column block of 16..128 or a "
                             "multiple of 128")
    tiles = tiles or _tiles(m)
    grid = (triton.cdiv(n, tiles["BLOCK_N"]), triton.cdiv(m, tiles["BLOCK_M"]))
    _gemm_kernel[grid](xq, xs, w, w_scale, out, m, n, k, xs.stride(0), w_scale.stride(0),
                       GROUP_K=group_k, SCALE_N=scale_n, BLOCK_K=block_k, DOT_F32=_DOT_F32, **tiles)
    return out


@functools.cache
def _unit_scale(device: torch.device) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32, device=device)


@functools.cache
def _cublaslt_block_scales(device: torch.device) -> bool:
    """torch._scaled_mm's 1x128 x 128x128 block scales run here: Hopper (sm90; torch takes other
    block layouts on sm100) with CUDA 12.9 or newer."""
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    return torch.cuda.get_device_capability(device)[0] == 9 and cuda >= (12, 9)


@triton.jit
def _scale_out_kernel(y_ptr, xs_ptr, ws_ptr, b_ptr, o_ptr, N, HAS_BIAS: tl.constexpr, ADD: tl.constexpr,
                      BLOCK: tl.constexpr):
    # program (row, c): o[row, c*BLOCK ...] (+)= y * xs[row] * ws[col] (+ bias[col]), rounded once
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    y = tl.load(y_ptr + row * N + cols, mask=ok, other=0.0).to(tl.float32)
    y = y * tl.load(xs_ptr + row) * tl.load(ws_ptr + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if ADD:
        y += tl.load(o_ptr + row * N + cols, mask=ok, other=0.0).to(tl.float32)
    dtype = o_ptr.dtype.element_ty   # (rounded: to nearest under the interpreter too, as on the GPU)
    tl.store(o_ptr + row * N + cols, rounded(y, dtype).to(dtype), mask=ok)


def scale_out(y: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None,
              into: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] (contiguous; the unit-scaled GEMM's output) times xs [M, 1] row by row and ws [N]
    column by column, plus bias: in place, or added into `into` (contiguous [M, N]) in place."""
    m, n = y.shape
    out = y if into is None else into
    assert out.is_contiguous() and out.shape == (m, n)
    if m:
        block = min(1024, triton.next_power_of_2(n))
        _scale_out_kernel[(m, triton.cdiv(n, block))](y, xs, ws, y if bias is None else bias, out, n,
                                                         HAS_BIAS=bias is not None, ADD=into is not None,
                                                         BLOCK=block, num_warps=4)
    return out


def _finish(y: torch.Tensor, bias: torch.Tensor | None, into: torch.Tensor | None,
            shape: torch.Size) -> torch.Tensor:
    y = y if bias is None else y + bias
    return y.view(*shape, y.shape[-1]) if into is None else into.add_(y.view(into.shape))


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int] | None,
               bias: torch.Tensor | None = None, into: torch.Tensor | None = None,
               scale_ub: float | None = None) -> torch.Tensor:
    """x: [..., K] -> [..., N] in x's dtype: the activations quantized (per token group of bk, or per
    token; scale_ub: quantize_activations'), then the FP8 GEMM; into ([..., N], contiguous): the output
    added into it in place (the residual stream), and returned."""
    shape, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    cublas = x.dtype == torch.bfloat16 and x2.shape[0] and not _DOT_F32
    if (cublas and BLOCK_GEMM == "cublas" and block == (128, 128) and k % 512 == 0 and w.shape[0] % 128 == 0
            and _cublaslt_block_scales(x.device)):   # whole blocks, K / 128 a multiple of 4
        # cuBLASLt's block-scaled GEMM takes a multiple of 4 rows (CUBLAS_STATUS_NOT_SUPPORTED
        # otherwise): the quantized rows are padded, the padding's output rows dropped.
        # scale_a [M, K/128] stride (1, M); scale_b [K/128, N/128] stride (1, K/128)
        rows = triton.cdiv(x2.shape[0], 4) * 4
        xq, xs = quantize_activations(x2, 128, m_major=True, rows=rows, scale_ub=scale_ub)
        y = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=w_scale.t(), out_dtype=x.dtype)[:x2.shape[0]]
        return _finish(y, bias, into, shape)
    xq, xs = quantize_activations(x2, k if block is None else block[1], scale_ub=scale_ub)
    if _channel_cublas(x2, w, block):
        # (fetched on every call, used or not, so that it is made at the first one: the eager
        # warm-up forward, before any CUDA graph is captured)
        _unit_scale(x.device)
        if x2.shape[0] <= UNIT_SCALE_MAX_M:   # per tensor, unit scales; then the scales, bias, residual
            y = _unit_scaled_mm(xq, w)
            out = scale_out(y, xs, w_scale.view(-1), bias, None if into is None else into.view(y.shape))
            return out.view(*shape, w.shape[0]) if into is None else into
        # cuBLASLt's FP8 GEMM with row-wise scales: scale_a [M, 1], scale_b [1, N]
        y = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=w_scale.view(1, -1), out_dtype=x.dtype,
                             use_fast_accum=FAST_ACCUM)
    else:
        y = fp8_gemm(xq, xs, w, w_scale, block, x.dtype)
    return _finish(y, bias, into, shape)


def _channel_cublas(x2: torch.Tensor, w: torch.Tensor, block: tuple[int, int] | None) -> bool:
    """Whether per-channel weights take cuBLASLt's GEMMs for x2 [M, K]: bf16 rows (at least one, on
    the GPU) and _scaled_mm's alignment; the unit-scale path up to UNIT_SCALE_MAX_M rows, row-wise above."""
    return (x2.dtype == torch.bfloat16 and x2.shape[0] > 0 and not _DOT_F32 and block is None
            and x2.shape[1] % 16 == 0 and w.shape[0] % 16 == 0)


def _unit_scaled_mm(xq: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """cuBLASLt's per-tensor FP8 GEMM with unit scales: xq [M, K] e4m3 times w [N, K]^T, unscaled, bf16."""
    one = _unit_scale(xq.device)
    return torch._scaled_mm(xq, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                            use_fast_accum=FAST_ACCUM)


def fp8_linear_unscaled(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                        block: tuple[int, int] | None, scale_ub: float | None = None
                        ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """fp8_linear without bias, its scales left to the caller where it takes the unit-scale path (and
    DEFER_SCALES is on): (y unscaled [..., N], (xs [M, 1], ws [N])), y * xs * ws rounded once being
    fp8_linear's output; elsewhere (fp8_linear(...), None)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if DEFER_SCALES and x2.shape[0] <= UNIT_SCALE_MAX_M and _channel_cublas(x2, w, block):   # the unit path
        xq, xs = quantize_activations(x2, k, scale_ub=scale_ub)
        return _unit_scaled_mm(xq, w).view(*x.shape[:-1], w.shape[0]), (xs, w_scale.view(-1))
    return fp8_linear(x, w, w_scale, block, scale_ub=scale_ub), None
