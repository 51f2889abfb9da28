"""Triton kernels for the model's elementwise ops: RMSNorm, RMSNorm fused with the residual add
before it, and SiLU-and-mul. Each reads its input once and writes its outputs once.

Numerics follow eager torch (kernels/reference.py, transformers' code) rounding for rounding:
  rms_norm:      fp32 sum of squares / hidden (exact division, as torch's CPU mean), rsqrt(+ eps),
                 x * rstd rounded to the dtype, then weight * that rounded again (torch's bf16 * bf16);
  add_rms_norm:  x + residual rounded to the dtype first, then the above;
  silu_and_mul:  gate / (1 + exp(-gate)) in fp32 (IEEE division, libdevice's expf: CUDA torch's
                 formula) rounded to the dtype, then times up rounded again; with an FP8 GEMM's
                 scales, gate and up are first (x * row scale) * column scale in fp32, rounded to
                 the dtype (fp8_gemm.scale_out's arithmetic).
Products are not contracted into FMAs (enable_fp_fusion=False). What can still differ on the GPU is
the order of the fp32 sum of squares, and torch's CUDA mean multiplies by float(1 / hidden), which
differs from a division only for a hidden size that is not a power of two: either can move rstd by
an ulp and so flip the rounding of a rare bf16 output. Under the interpreter, exp is numpy's.
"""
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

import nanovllm.envs as envs
from nanovllm.kernels.common import rounded, row_rstd

# SiLU-and-mul's column block (output values a program computes at a time). Scaled (norm_of given),
# every program first reads its row of norm_of for rstd. From SILU_WHOLE_ROWS rows on (prefill steps)
# a program takes a whole row, rstd computed once, walking its columns a block at a time; below it
# (decode, where more programs in flight pay) each program takes one block, widened to norm_of's
# width, so the row is read at most once per output value (Qwen3-8B: 4096, not 12 reads a row of
# 1024 outputs each; benchmarks/RESULTS.md has the sweep).
SILU_BLOCK = 1024
SILU_WHOLE_ROWS = envs.SILU_WHOLE_ROWS.get()


@triton.jit(do_not_specialize=["num_rows"])   # one compiled variant whatever the step's token count
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, num_rows, x_stride, res_stride, eps,
                     HIDDEN: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr):
    # A program normalises BLOCK_ROWS rows (several only when hidden is small) as one tile.
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[:, None]
    cols = tl.arange(0, BLOCK_H)[None, :]
    mask = (rows < num_rows) & (cols < HIDDEN)
    rows = rows.to(tl.int64)
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + rows * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        x = rounded(x + r, dtype)
        tl.store(res_out_ptr + rows * HIDDEN + cols, x.to(dtype), mask=mask)
    sum_sq = tl.sum(x * x, axis=1)
    mean_sq = tl.math.div_rn(sum_sq, tl.full(sum_sq.shape, HIDDEN, tl.float32))
    rstd = tl.math.rsqrt(mean_sq + eps)[:, None]
    w = tl.load(w_ptr + cols, mask=cols < HIDDEN, other=0.0).to(tl.float32)
    out_dtype = out_ptr.dtype.element_ty
    out = rounded(rounded(x * rstd, dtype) * w, out_dtype)
    tl.store(out_ptr + rows * HIDDEN + cols, out.to(out_dtype), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x: [..., hidden] -> [rows, hidden] with contiguous rows (a view when it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    hidden = x.shape[-1]
    assert weight.shape == (hidden,) and weight.is_contiguous()
    x2 = _rows(x)
    # weight * x.to(dtype) promotes: an fp32 weight gives an fp32 output, as in eager torch
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    num_rows = x2.shape[0]
    if num_rows:
        r2 = _rows(residual) if residual is not None else x2
        block_h = triton.next_power_of_2(hidden)
        block_rows = max(1, 1024 // block_h)   # small hidden sizes: several rows per program
        _rms_norm_kernel[(triton.cdiv(num_rows, block_rows),)](
            x2, r2, weight, out, res_out if residual is not None else out, num_rows, x2.stride(0),
            r2.stride(0), eps, HIDDEN=hidden, BLOCK_ROWS=block_rows, BLOCK_H=block_h,
            HAS_RESIDUAL=residual is not None,
            # ~16 values a thread: 2 warps for hidden 1024, 8 for 4096 (a first guess, untimed)
            num_warps=min(16, max(1, block_rows * block_h // 512)), enable_fp_fusion=False)
    return out, res_out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden], weight: [hidden] -> weight * normalised x: [..., hidden].
    Allocates only the output, and never syncs: CUDA-graph safe."""
    return _launch_rms_norm(x, None, weight, eps)[0]


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """x, residual: [..., hidden] -> (rms_norm(x + residual), x + residual), from one read of each.
    CUDA-graph safe."""
    assert residual.shape == x.shape and residual.dtype == x.dtype
    return _launch_rms_norm(x, residual, weight, eps)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, norm_ptr, xs_ptr, ws_ptr, x_stride, norm_stride, eps,
                         D: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
                         LIBDEVICE_EXP: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_HIDDEN: tl.constexpr,
                         SCALED: tl.constexpr, FP8_SCALES: tl.constexpr):
    # Grid (rows, column spans): program (t, j) computes out[t, j * CHUNKS * BLOCK:(j + 1) * CHUNKS * BLOCK],
    # BLOCK columns at a time. FP8_SCALES: gate and up first times xs[t] and ws[column], rounded to the
    # dtype (fp8_gemm.scale_out's arithmetic). SCALED: then times rstd of row t of norm_ptr (HIDDEN
    # wide), rounded to the dtype.
    row = tl.program_id(0).to(tl.int64)
    dtype = x_ptr.dtype.element_ty
    if SCALED:
        rstd = row_rstd(norm_ptr + row * norm_stride, eps, HIDDEN, BLOCK_HIDDEN)
    if FP8_SCALES:
        xs = tl.load(xs_ptr + row)
    for c in range(CHUNKS):
        cols = (tl.program_id(1) * CHUNKS + c) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < D
        gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * x_stride + D + cols, mask=mask, other=0.0).to(tl.float32)
        if FP8_SCALES:
            gate = rounded(gate * xs * tl.load(ws_ptr + cols, mask=mask, other=0.0), dtype)
            up = rounded(up * xs * tl.load(ws_ptr + D + cols, mask=mask, other=0.0), dtype)
        if SCALED:
            gate = rounded(gate * rstd, dtype)
            up = rounded(up * rstd, dtype)
        if LIBDEVICE_EXP:   # CUDA's expf, as torch's silu calls it; tl.exp is a faster approximation
            e = libdevice.exp(-gate)
        else:               # the interpreter has no libdevice
            e = tl.exp(-gate)
        silu = rounded(tl.math.div_rn(gate, 1.0 + e), dtype)
        tl.store(out_ptr + row * D + cols, rounded(silu * up, dtype).to(dtype), mask=mask)


def silu_and_mul_triton(x: torch.Tensor, norm_of: torch.Tensor | None = None, eps: float = 0.0,
                        fp8_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x: [..., 2 * d] holding gate | up -> silu(gate) * up: [..., d]. fp8_scales: (xs [rows, 1], ws
    [2 * d], fp32), x an unscaled FP8 GEMM's output (fp8_gemm.fp8_linear_unscaled), first scaled by
    them. norm_of: [..., hidden], gate and up then scaled by its rows' rstd
    (reference.scale_by_rstd_ref). CUDA-graph safe."""
    d = x.shape[-1] // 2
    assert x.shape[-1] == 2 * d
    x2 = _rows(x)
    h2 = _rows(norm_of) if norm_of is not None else x2
    assert norm_of is None or h2.shape[0] == x2.shape[0]
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    xs, ws = fp8_scales if fp8_scales is not None else (x2, x2)   # pointers the kernel never reads
    assert fp8_scales is None or (xs.shape == (len(x2), 1) and ws.shape == (2 * d,) and xs.is_contiguous()
                                  and ws.is_contiguous() and xs.dtype == ws.dtype == torch.float32)
    if x2.shape[0] and d:
        hidden = h2.shape[-1] if norm_of is not None else 1
        rows = x2.shape[0]
        if norm_of is not None and rows >= SILU_WHOLE_ROWS:   # one program a row, rstd computed once
            block = min(SILU_BLOCK, triton.next_power_of_2(d))
            chunks, spans = triton.cdiv(d, block), 1
        else:
            block = min(max(SILU_BLOCK, triton.next_power_of_2(hidden)), triton.next_power_of_2(d))
            chunks, spans = 1, triton.cdiv(d, block)
        _silu_and_mul_kernel[(rows, spans)](
            x2, out, h2, xs, ws, x2.stride(0), h2.stride(0), eps, D=d, BLOCK=block, CHUNKS=chunks,
            LIBDEVICE_EXP=x.is_cuda, HIDDEN=hidden, BLOCK_HIDDEN=triton.next_power_of_2(hidden),
            SCALED=norm_of is not None, FP8_SCALES=fp8_scales is not None,
            # 8 values a thread (16 above a block of 4096)
            num_warps=min(16, max(1, block // 256)), enable_fp_fusion=False)
    return out
