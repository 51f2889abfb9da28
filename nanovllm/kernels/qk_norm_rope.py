"""One Triton kernel for what sits between qkv_proj and attention: per-head q/k RMSNorm (Qwen3),
neox rotary on q and k, and the K/V write into the paged cache.

Run separately that is four launches per layer (q norm, k norm, rotary, store), each re-reading q
or k; fused, one kernel reads qkv once. Grid (num_tokens, 2): program (t, 0) handles token t's
query heads, program (t, 1) its key heads, their cache rows and the value rows. A program holds
all its heads as one [heads, head_dim / 2] tile per rotary half, so rotate_half needs no shuffle.

Numerics follow eager torch's rms_norm then apply_rotary_ref (transformers' roundings) rounding for
rounding: normalise in fp32, cast to the dtype, multiply by the weight and round again (torch's
bf16 * bf16), then rotate in fp32 (products rounded before the add: no FMA contraction) and cast
back. Only the order of the fp32 sum of squares differs from eager, which can move a rare value by
one ulp.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.common import interpreted, rounded, row_rstd


@triton.jit
def _head_halves(NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_HALF: tl.constexpr):
    """A [BLOCK_H, BLOCK_HALF] tile over the first halves of NUM_HEADS heads stored [NUM_HEADS,
    HEAD_DIM] contiguous: (offsets, mask, column index); the second halves lie HEAD_DIM // 2 further."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    return heads * HEAD_DIM + cols, (heads < NUM_HEADS) & (cols < HEAD_DIM // 2), cols


@triton.jit
def _norm_rope_heads(src_ptr, w_ptr, dst_ptr, cos, sin, eps, row_scale, NUM_HEADS: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                     HAS_NORM: tl.constexpr, SCALED: tl.constexpr):
    """Normalise and rotate a token's NUM_HEADS heads from src_ptr into dst_ptr (both [NUM_HEADS,
    HEAD_DIM] contiguous); return the two rotated halves in the source dtype. SCALED: the heads
    first times row_scale (the token's rstd), rounded to the dtype."""
    half: tl.constexpr = HEAD_DIM // 2
    offs, mask, cols = _head_halves(NUM_HEADS, HEAD_DIM, BLOCK_H, BLOCK_HALF)
    dtype = src_ptr.dtype.element_ty
    x1 = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + offs + half, mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        x1 = rounded(x1 * row_scale, dtype)
        x2 = rounded(x2 * row_scale, dtype)
    if HAS_NORM:
        mean_sq = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM
        rstd = tl.math.rsqrt(mean_sq + eps)[:, None]
        w1 = tl.load(w_ptr + cols, mask=cols < half, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + cols + half, mask=cols < half, other=0.0).to(tl.float32)
        x1 = rounded(rounded(x1 * rstd, dtype) * w1, dtype)
        x2 = rounded(rounded(x2 * rstd, dtype) * w2, dtype)
    out1 = rounded(x1 * cos - x2 * sin, dtype).to(dtype)
    out2 = rounded(x2 * cos + x1 * sin, dtype).to(dtype)
    tl.store(dst_ptr + offs, out1, mask=mask)
    tl.store(dst_ptr + offs + half, out2, mask=mask)
    return out1, out2


@triton.jit
def _fp8_e4m3(x, scale, INTERPRETED: tl.constexpr):
    """x / scale (IEEE division) saturated to +-448, for a cast to e4m3 that rounds it to nearest
    with ties to even and keeps subnormals (torch's cast): on the GPU the cast itself does
    (cvt.rn.satfinite); in the Triton interpreter, whose fp8 cast rounds ties up and flushes
    subnormals, the value is rounded here by arithmetic, to one that e4m3 holds exactly."""
    x = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
    if not INTERPRETED:
        return x
    bits = x.to(tl.uint32, bitcast=True)
    # Normal range (|x| >= 2^-6): round the 23-bit mantissa to 3 bits (to nearest even, as for bf16).
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    # Subnormals: multiples of 2^-9. Adding 1.5 * 2^14 rounds |x| there (fp32 ulp 2^-9); sign kept.
    tiny = (tl.abs(x) + 24576.0) - 24576.0
    subnormal = (tiny.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def _store_kv_rows(k1, k2, v1, v2, k_dst_ptr, v_dst_ptr, k_scale_ptr, v_scale_ptr, NUM_KV_HEADS: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_KV_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   FP8: tl.constexpr, INTERPRETED: tl.constexpr):
    """Write one token's rotated key halves and its value halves into its cache rows (FP8:
    quantized with the layer's scales)."""
    half: tl.constexpr = HEAD_DIM // 2
    offs, mask, _ = _head_halves(NUM_KV_HEADS, HEAD_DIM, BLOCK_KV_H, BLOCK_HALF)
    cache_dtype = k_dst_ptr.dtype.element_ty
    if FP8:
        k_scale = tl.load(k_scale_ptr)
        k1 = _fp8_e4m3(k1.to(tl.float32), k_scale, INTERPRETED)
        k2 = _fp8_e4m3(k2.to(tl.float32), k_scale, INTERPRETED)
    tl.store(k_dst_ptr + offs, k1.to(cache_dtype), mask=mask)
    tl.store(k_dst_ptr + offs + half, k2.to(cache_dtype), mask=mask)
    if FP8:
        v_scale = tl.load(v_scale_ptr)
        v1 = _fp8_e4m3(v1.to(tl.float32), v_scale, INTERPRETED)
        v2 = _fp8_e4m3(v2.to(tl.float32), v_scale, INTERPRETED)
    tl.store(v_dst_ptr + offs, v1.to(cache_dtype), mask=mask)
    tl.store(v_dst_ptr + offs + half, v2.to(cache_dtype), mask=mask)


@triton.jit
def _qk_norm_rope_store_kernel(qkv_ptr, q_ptr, k_ptr, v_ptr, q_w_ptr, k_w_ptr, cos_sin_ptr, pos_ptr, slot_ptr,
                               k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, norm_ptr, eps, norm_eps,
                               qkv_stride, cos_sin_stride, norm_stride, NUM_HEADS: tl.constexpr,
                               NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                               BLOCK_KV_H: tl.constexpr, BLOCK_HALF: tl.constexpr, HAS_NORM: tl.constexpr,
                               STORE: tl.constexpr, FP8: tl.constexpr, INTERPRETED: tl.constexpr,
                               HIDDEN: tl.constexpr, BLOCK_HIDDEN: tl.constexpr, SCALED: tl.constexpr):
    # SCALED: the input RMSNorm folded into qkv_proj: q, k and v first times the token's rstd of
    # its row of norm_ptr (HIDDEN wide); v, scaled, is written to v_ptr.
    token = tl.program_id(0).to(tl.int64)
    row_scale = 1.0
    if SCALED:
        row_scale = row_rstd(norm_ptr + token * norm_stride, norm_eps, HIDDEN, BLOCK_HIDDEN)
    half: tl.constexpr = HEAD_DIM // 2
    q_size: tl.constexpr = NUM_HEADS * HEAD_DIM
    kv_size: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    cs_row = cos_sin_ptr + tl.load(pos_ptr + token) * cos_sin_stride
    cos = tl.load(cs_row + cols, mask=cols < half, other=0.0)
    sin = tl.load(cs_row + half + cols, mask=cols < half, other=0.0)
    q_row = qkv_ptr + token * qkv_stride          # a qkv row: q heads | k heads | v heads
    k_row = q_row + q_size
    # The two branches are helper calls: Triton types a variable set in both branches of an if
    # as one, and the q and k tiles differ in shape.
    if tl.program_id(1) == 0:
        _norm_rope_heads(q_row, q_w_ptr, q_ptr + token * q_size, cos, sin, eps, row_scale,
                         NUM_HEADS, HEAD_DIM, BLOCK_H, BLOCK_HALF, HAS_NORM, SCALED)
    else:
        k1, k2 = _norm_rope_heads(k_row, k_w_ptr, k_ptr + token * kv_size, cos, sin, eps, row_scale,
                                  NUM_KV_HEADS, HEAD_DIM, BLOCK_KV_H, BLOCK_HALF, HAS_NORM, SCALED)
        if SCALED or STORE:   # the values: scaled into v_ptr, stored into the cache
            v_offs, v_mask, _ = _head_halves(NUM_KV_HEADS, HEAD_DIM, BLOCK_KV_H, BLOCK_HALF)
            v1 = tl.load(k_row + kv_size + v_offs, mask=v_mask)
            v2 = tl.load(k_row + kv_size + v_offs + half, mask=v_mask)
            if SCALED:
                dtype = qkv_ptr.dtype.element_ty
                v1 = rounded(v1.to(tl.float32) * row_scale, dtype).to(dtype)
                v2 = rounded(v2.to(tl.float32) * row_scale, dtype).to(dtype)
                tl.store(v_ptr + token * kv_size + v_offs, v1, mask=v_mask)
                tl.store(v_ptr + token * kv_size + v_offs + half, v2, mask=v_mask)
            if STORE:
                slot = tl.load(slot_ptr + token).to(tl.int64)
                if slot >= 0:   # -1: a padding row, written nowhere
                    _store_kv_rows(k1, k2, v1, v2, k_cache_ptr + slot * kv_size,
                                   v_cache_ptr + slot * kv_size, k_scale_ptr, v_scale_ptr,
                                   NUM_KV_HEADS, HEAD_DIM, BLOCK_KV_H, BLOCK_HALF, FP8, INTERPRETED)


def qk_norm_rope_store_triton(qkv: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                              eps: float, cos_sin_cache: torch.Tensor, positions: torch.Tensor,
                              slot_mapping: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              num_heads: int, num_kv_heads: int, head_dim: int,
                              k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                              norm_of: torch.Tensor | None = None, norm_eps: float = 0.0):
    """qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim], rows contiguous
    -> q: [num_tokens, num_heads, head_dim], k, v: [num_tokens, num_kv_heads, head_dim] (v a view of
    qkv, or, with norm_of [num_tokens, hidden], qkv's v scaled by rstd(norm_of) like q and k).
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], or empty: no store.
    k_scale, v_scale: [1] fp32, read on the device (needed for an FP8 cache, unused otherwise).
    Allocates only outputs shaped like qkv, and never syncs: CUDA-graph safe."""
    num_tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    assert qkv.shape[1] == q_size + 2 * kv_size and qkv.stride(1) == 1 and head_dim % 2 == 0
    assert (q_weight is None) == (k_weight is None)
    assert q_weight is None or q_weight.dtype == k_weight.dtype == qkv.dtype
    assert cos_sin_cache.shape[1] == head_dim and cos_sin_cache.stride(1) == 1
    store = k_cache.numel() > 0
    assert not store or (k_cache.is_contiguous() and v_cache.is_contiguous()
                         and k_cache.shape[2:] == (num_kv_heads, head_dim)
                         and slot_mapping.numel() == num_tokens)
    fp8 = store and k_cache.dtype == torch.float8_e4m3fn
    assert not fp8 or (k_scale is not None and v_scale is not None), "an FP8 cache needs k_scale and v_scale"
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(num_tokens, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    scaled = norm_of is not None
    if scaled:
        assert norm_of.shape[0] == num_tokens and norm_of.stride(-1) == 1
        v = torch.empty(num_tokens, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    else:
        v = qkv[:, q_size + kv_size:].view(num_tokens, num_kv_heads, head_dim)
    if num_tokens == 0:
        return q, k, v
    has_norm = q_weight is not None
    # ~16 values of each half per thread: 2 warps for Qwen3-0.6B's 16 heads of 128 (the fastest
    # tried, benchmarks/RESULTS.md)
    block_h, block_half = triton.next_power_of_2(num_heads), triton.next_power_of_2(head_dim // 2)
    hidden = norm_of.shape[-1] if scaled else 1
    _qk_norm_rope_store_kernel[(num_tokens, 2)](
        qkv, q, k, v, q_weight if has_norm else qkv, k_weight if has_norm else qkv, cos_sin_cache,
        positions, slot_mapping if store else positions, k_cache if store else qkv,
        v_cache if store else qkv, k_scale if fp8 else qkv, v_scale if fp8 else qkv,
        norm_of if scaled else qkv, eps, norm_eps, qkv.stride(0), cos_sin_cache.stride(0),
        norm_of.stride(0) if scaled else 0,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=block_h, BLOCK_KV_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=block_half, HAS_NORM=has_norm, STORE=store, FP8=fp8, INTERPRETED=interpreted(qkv.device),
        HIDDEN=hidden, BLOCK_HIDDEN=triton.next_power_of_2(hidden), SCALED=scaled,
        num_warps=min(8, max(1, block_h * block_half // 512)), enable_fp_fusion=False)
    return q, k, v
