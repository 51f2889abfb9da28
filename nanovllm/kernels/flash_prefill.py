"""Prefill attention on CUDA: torch's built-in FlashAttention-2 varlen op.

`torch.ops.aten._flash_attention_forward` is private and its keyword arguments have changed between
releases, so the wrapper reads the op's schema once and only passes what it accepts. Its causal mask is
bottom-right aligned for varlen inputs, as ours is. It wants fp16/bf16 and head_dim <= 256.
With a paged cache the keys are first gathered into a contiguous varlen buffer (from an FP8 cache,
dequantized into the query's dtype by one Triton kernel: gather, scale and cast in one pass, where
torch's ops took four over fp32 copies).
"""
import functools

import torch
import triton
import triton.language as tl

from nanovllm.kernels.common import rounded
from nanovllm.kernels.reference import prefill_attention_ref


def _aten_flash_op():
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if op is None:
        return None, ()
    try:
        names = tuple(a.name for a in op.default._schema.arguments)
    except (AttributeError, RuntimeError):
        return None, ()
    positional = ("query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k",
                  "dropout_p", "is_causal", "return_debug_mask")
    if names[:len(positional)] != positional:
        return None, names
    return op, names


_FLASH_OP, _FLASH_ARGS = _aten_flash_op()
# True when the schema looks usable; whether the build has the CUDA kernel is only known on first use.
AVAILABLE = _FLASH_OP is not None


def aten_flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                      max_seqlen_q: int, max_seqlen_k: int, scale: float) -> torch.Tensor:
    # q: [total_q, num_heads, head_dim]; k, v: [total_k, num_heads or num_kv_heads, head_dim]; causal
    if "scale" in _FLASH_ARGS:
        kwargs = {"scale": scale}
    else:  # very old releases: scale the query instead (the op's default is 1/sqrt(head_dim))
        q, kwargs = q * (scale * q.shape[-1] ** 0.5), {}
    out = _FLASH_OP(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    0.0, True, False, **kwargs)
    return out[0]


@functools.cache
def aten_flash_mode(device: torch.device) -> str | None:
    """Probe once per device on tiny shapes. "gqa": the op takes fewer KV heads than query heads;
    "expand": it needs KV heads repeated; None: this build cannot run it (fall back to the reference)."""
    if not AVAILABLE:
        return None
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(5, h, 64, device=device, generator=gen).to(torch.bfloat16) for h in (4, 2, 2))
    cu = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)
    ref = prefill_attention_ref(q, k, v, None, None, cu, cu, 3, 3, None, 0.125).float()
    for mode, group in (("gqa", 1), ("expand", 2)):
        try:
            out = aten_flash_varlen(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                    cu, cu, 3, 3, 0.125)
        except RuntimeError:
            continue
        if torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2):
            return mode
    return None


def aten_flash_usable(q: torch.Tensor) -> bool:
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256
            and q.shape[-1] % 8 == 0 and aten_flash_mode(q.device) is not None)


def gather_kv_varlen(k_cache: torch.Tensor, v_cache: torch.Tensor,
                     kv_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # -> k, v: [total_k, num_kv_heads, head_dim], the rows of paged_kv_slots
    _, _, num_kv_heads, head_dim = k_cache.shape
    k = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, kv_slots)
    v = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, kv_slots)
    return k, v


@triton.jit
def _gather_dequantize_kernel(cache_ptr, slots_ptr, scale_ptr, out_ptr, total, ROW: tl.constexpr,
                              BLOCK_T: tl.constexpr, BLOCK_ROW: tl.constexpr):
    # Program i fills rows [i * BLOCK_T, (i + 1) * BLOCK_T) of the varlen buffer: row t is the cache
    # row of slot slots[t] (ROW values: every KV head of one token), times the scale, cast to out's dtype.
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_ROW)
    mask = (tokens < total)[:, None] & (cols < ROW)[None, :]
    slots = tl.load(slots_ptr + tokens, mask=tokens < total, other=0)
    rows = tl.load(cache_ptr + slots[:, None] * ROW + cols[None, :], mask=mask, other=0.0)
    out = rounded(rows.to(tl.float32) * tl.load(scale_ptr), out_ptr.dtype.element_ty)
    tl.store(out_ptr + tokens[:, None].to(tl.int64) * ROW + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask)


def gather_dequantize_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_slots: torch.Tensor,
                         k_scale: torch.Tensor, v_scale: torch.Tensor,
                         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """gather_kv_varlen from an FP8 cache, each value times its scale in fp32 and rounded to dtype
    (reference.dequantize_kv's numbers): k, v [total_k, num_kv_heads, head_dim] in dtype."""
    _, _, num_kv_heads, head_dim = k_cache.shape
    total, row = kv_slots.numel(), num_kv_heads * head_dim
    k, v = (torch.empty(total, num_kv_heads, head_dim, dtype=dtype, device=k_cache.device) for _ in range(2))
    if total == 0:
        return k, v
    block_t = 4
    grid = (triton.cdiv(total, block_t),)
    for cache, scale, out in ((k_cache, k_scale, k), (v_cache, v_scale, v)):
        _gather_dequantize_kernel[grid](cache, kv_slots, scale, out, total, ROW=row, BLOCK_T=block_t,
                                        BLOCK_ROW=triton.next_power_of_2(row), num_warps=4)
    return k, v


def prefill_attention_aten(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           max_seqlen_q: int, max_seqlen_k: int,
                           block_tables: torch.Tensor | None, scale: float,
                           kv_slots: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    # The interface of backend.prefill_attention; only when aten_flash_usable(q).
    if block_tables is not None and k_cache.dtype == torch.float8_e4m3fn:
        k, v = gather_dequantize_kv(k_cache, v_cache, kv_slots, k_scale, v_scale, q.dtype)
    elif block_tables is not None:
        k, v = gather_kv_varlen(k_cache, v_cache, kv_slots)
    group = q.shape[1] // k.shape[1]
    if group > 1 and aten_flash_mode(q.device) == "expand":
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    return aten_flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale)
