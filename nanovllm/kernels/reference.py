"""Plain torch RMSNorm, SiLU-and-mul, attention, KV-store and q/k norm + rotary: the CPU path and
the oracle of the kernel tests.

RMSNorm and SiLU-and-mul are transformers' code, whose roundings the kernels reproduce. The attention
functions compute in fp32 and return the dtype of their query. Query head h reads KV head
h // (num_heads // num_kv_heads), the grouping of Hugging Face's `repeat_kv`.

An FP8 cache (float8_e4m3fn) holds K / k_scale and V / v_scale, where k_scale and v_scale are one
fp32 number per layer ([1] tensors; None reads as 1.0): stored values are divided by the scale,
saturated to +-448 and rounded to nearest; read values are multiplied by it, in fp32.
"""
import torch
import torch.nn.functional as F


FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0   # e4m3fn's largest finite value (it has no infinities)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x / scale in fp32, saturated to +-FP8_MAX, rounded to e4m3 (to nearest, ties to even)."""
    x = x.float() if scale is None else x.float() / scale
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv(rows: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache rows as numbers: FP8 rows times their scale in fp32; other dtypes as they are."""
    if rows.dtype != FP8_DTYPE:
        return rows
    return rows.float() if scale is None else rows.float() * scale


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers computes it: normalise in fp32, cast back, then scale (rounded again).
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    x = x + residual
    return rms_norm_ref(x, weight, eps), x


def scale_by_rstd_ref(x: torch.Tensor, norm_of: torch.Tensor, eps: float) -> torch.Tensor:
    """x times rstd(norm_of) row by row, rounded to x's dtype: what remains of an RMSNorm whose weight
    was folded into the GEMM that made x from norm_of (x = norm_of W^T, W's columns times the
    norm's weight). norm_of: [..., hidden]; x: [..., n] with the same leading shape."""
    h = norm_of.float()
    return (x.float() * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def silu_and_mul_ref(x: torch.Tensor, norm_of: torch.Tensor | None = None, eps: float = 0.0,
                     fp8_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    # x: [..., 2 * d] = gate | up -> [..., d]; fp8_scales (xs [rows, 1], ws [2 * d]): x an FP8 GEMM's
    # unscaled output, first scaled by them; norm_of: gate | up then scaled by its rows' rstd
    if fp8_scales is not None:
        xs, ws = fp8_scales
        x = (x.float() * xs.view(*x.shape[:-1], 1) * ws).to(x.dtype)
    if norm_of is not None:
        x = scale_by_rstd_ref(x, norm_of, eps)
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


def qk_norm_rope_store_ref(qkv: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                           eps: float, cos_sin_cache: torch.Tensor, positions: torch.Tensor,
                           slot_mapping: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           num_heads: int, num_kv_heads: int, head_dim: int,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           norm_of: torch.Tensor | None = None, norm_eps: float = 0.0):
    """The layers' own ops, one after another: qkv scaled by rstd(norm_of) row by row (when given:
    the input RMSNorm folded into qkv_proj), per-head RMSNorm of q and k (when weights are given),
    rotary, then the K/V store (skipped while the cache is empty, as in the warm-up run; an FP8
    cache stores K / k_scale and V / v_scale).
    qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
    -> q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]"""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    if norm_of is not None:
        qkv = scale_by_rstd_ref(qkv, norm_of, norm_eps)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(-1, num_heads, head_dim)
    k = k.view(-1, num_kv_heads, head_dim)
    v = v.view(-1, num_kv_heads, head_dim)
    if q_weight is not None:
        # Normalised as [tokens * heads, head_dim] rows: the same 2-D shape as every other RMSNorm.
        q = rms_norm_ref(q.reshape(-1, head_dim), q_weight, eps).view(q.shape)
        k = rms_norm_ref(k.reshape(-1, head_dim), k_weight, eps).view(k.shape)
    q, k = apply_rotary_ref(positions, q, k, cos_sin_cache)
    if k_cache.numel():
        store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q, k, v


def apply_rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor):
    """Neox rotary (rotate_half) in fp32, cast back. positions: [num_tokens];
    q, k: [num_tokens, heads, head_dim]; cos_sin_cache: [max_position, head_dim] = cos half | sin half"""
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def store_kvcache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    # key, value: [num_tokens, num_kv_heads, head_dim]
    # k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    # A slot of -1 marks a padding row that must not be written.
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    if k_cache.dtype == FP8_DTYPE:
        k_flat[slots] = quantize_fp8(key[keep], k_scale)
        v_flat[slots] = quantize_fp8(value[keep], v_scale)
    else:
        k_flat[slots] = key[keep].to(k_cache.dtype)
        v_flat[slots] = value[keep].to(v_cache.dtype)


def gather_paged_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence, [length, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blocks = block_table[pos // block_size].long()
    return cache[blocks, pos % block_size]


def soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """Logit soft-capping (Gemma 2): cap * tanh(s / cap), which keeps |s| below cap; 0: none."""
    return scores if not cap else torch.tanh(scores / cap) * cap


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
            scale: float, softcap: float = 0.0) -> torch.Tensor:
    # q: [q_len, num_heads, head_dim]; k, v: [k_len, num_kv_heads, head_dim]; mask: [q_len, k_len] bool
    q_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    qg = q.float().view(q_len, num_kv_heads, group, head_dim)
    scores = soft_cap(torch.einsum("qhgd,khd->hgqk", qg, k.float()) * scale, softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no visible key gives zeros
    out = torch.einsum("hgqk,khd->qhgd", probs, v.float())
    return out.reshape(q_len, num_heads, head_dim)


def causal_mask(q_len: int, k_len: int, device, window: int = 0) -> torch.Tensor:
    """Bottom-right aligned: query j sits at position k_len - q_len + j and sees keys 0..that; with a
    sliding window (window > 0) only the last `window` of them (keys more than window - 1 positions
    before the query are masked)."""
    q_pos = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
    k_pos = torch.arange(k_len, device=device)[None, :]
    visible = k_pos <= q_pos
    return visible & (k_pos > q_pos - window) if window > 0 else visible


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float, k_scale: torch.Tensor | None = None,
                               v_scale: torch.Tensor | None = None, *, window: int = 0,
                               softcap: float = 0.0) -> torch.Tensor:
    # q: [batch, num_heads, head_dim]; block_tables: [batch, max_blocks]; context_lens: [batch]
    # Rows with context_len 0 (graph padding) give zeros. window > 0: the query (at position
    # context_len - 1) sees only the last `window` keys; softcap > 0: scores soft-capped.
    batch, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    max_tokens = block_tables.shape[1] * block_size
    blocks = block_tables.long().clamp(0, num_blocks - 1)
    k = dequantize_kv(k_cache[blocks], k_scale).reshape(batch, max_tokens, num_kv_heads, head_dim).float()
    v = dequantize_kv(v_cache[blocks], v_scale).reshape(batch, max_tokens, num_kv_heads, head_dim).float()
    group = num_heads // num_kv_heads
    qg = q.float().view(batch, num_kv_heads, group, head_dim)
    scores = soft_cap(torch.einsum("bhgd,bthd->bhgt", qg, k) * scale, softcap)
    k_pos, ends = torch.arange(max_tokens, device=q.device)[None, :], context_lens[:, None].long()
    visible = k_pos < ends
    if window > 0:
        visible &= k_pos >= ends - window
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhgt,bthd->bhgd", probs, v)
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


def prefill_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          k_cache: torch.Tensor | None, v_cache: torch.Tensor | None,
                          cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                          max_seqlen_q: int, max_seqlen_k: int,
                          block_tables: torch.Tensor | None, scale: float,
                          k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                          *, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    # q: [total_q, num_heads, head_dim]; k, v: [total_q, num_kv_heads, head_dim] (the new tokens)
    # With block_tables, keys come from the paged cache (cached prefix + the new tokens, already
    # stored: from an FP8 cache, the new tokens' keys too are read back quantized). window, softcap:
    # as in paged_decode_attention_ref (causal_mask, soft_cap).
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    cu_q = cu_seqlens_q.tolist()
    cu_k = cu_seqlens_k.tolist()
    for i in range(len(cu_q) - 1):
        q_lo, q_hi = cu_q[i], cu_q[i + 1]
        q_len, k_len = q_hi - q_lo, cu_k[i + 1] - cu_k[i]
        if q_len == 0:
            continue
        if block_tables is None:
            assert k_len == q_len, "without block_tables no sequence may have a cached prefix"
            ki, vi = k[q_lo:q_hi], v[q_lo:q_hi]
        else:
            ki = dequantize_kv(gather_paged_kv(k_cache, block_tables[i], k_len), k_scale)
            vi = dequantize_kv(gather_paged_kv(v_cache, block_tables[i], k_len), v_scale)
        mask = causal_mask(q_len, k_len, q.device, window)
        out[q_lo:q_hi] = _attend(q[q_lo:q_hi], ki, vi, mask, scale, softcap).to(q.dtype)
    return out
