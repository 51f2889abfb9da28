"""Triton kernel that writes the new tokens' K/V into the paged cache."""
import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                          key_stride, value_stride, ROW: tl.constexpr, BLOCK: tl.constexpr):
    # One program per token; a row is num_kv_heads * head_dim contiguous elements.
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    # slot -1: a padding row, written nowhere (broadcast first: the interpreter wants a tensor mask)
    mask = (cols < ROW) & ((slot + tl.zeros([BLOCK], dtype=tl.int64)) >= 0)
    k = tl.load(key_ptr + token.to(tl.int64) * key_stride + cols, mask=mask)
    v = tl.load(value_ptr + token.to(tl.int64) * value_stride + cols, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + cols, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * ROW + cols, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    # key, value: [num_tokens, num_kv_heads, head_dim], heads and dims contiguous (a slice of qkv is fine)
    # k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    num_tokens, num_kv_heads, head_dim = key.shape
    row = num_kv_heads * head_dim
    assert key.stride(-1) == 1 and key.stride(1) == head_dim
    assert value.stride(-1) == 1 and value.stride(1) == head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert slot_mapping.numel() == num_tokens
    if num_tokens == 0:
        return
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0),
        ROW=row, BLOCK=triton.next_power_of_2(row))
