"""Prefill attention through FlashAttention-4 (the optional `flash-attn-4` package, CuTe DSL):
one varlen call per layer, straight over the paged cache when sequences have a cached prefix or
earlier chunks (`page_table` + `seqused_k`, no gather), GQA native.

Imported only when it is chosen (nanovllm.layers.prefill_attention), so nothing here
runs for users without the package. FA4's causal mask is bottom-right aligned when a sequence has
more keys than queries (the last query sees every key), as ours is. Its paged path needs Hopper
(sm90) or sm100/sm110; it reads FP8 K/V (with descales) only on sm100 and only with FP8 queries, so
a prefill that reads an FP8 cache takes torch_flash's path (gather, dequantize, torch's FlashAttention-2).
"""
import torch
from flash_attn.cute import flash_attn_varlen_func

from nanovllm.kernels.backend import prefill_attention

_HALF = (torch.float16, torch.bfloat16)


def fa4_fits(q: torch.Tensor, k_cache: torch.Tensor, paged: bool) -> bool:
    """What FA4 runs (it asserts on the rest, which takes kernels.prefill_attention instead): fp16/bf16,
    head_dim a multiple of 8 up to 256 on sm90 (up to 128, or 256, on sm100), and a cache of the
    query's dtype when it reads the pages."""
    head_dim, major = q.shape[-1], torch.cuda.get_device_capability(q.device)[0]
    dims_ok = head_dim % 8 == 0 and (8 <= head_dim <= (256 if major == 9 else 128) or head_dim == 256)
    return q.dtype in _HALF and dims_ok and (not paged or k_cache.dtype == q.dtype)


def prefill_attention_fa4(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                          max_seqlen_q: int, max_seqlen_k: int,
                          block_tables: torch.Tensor | None, scale: float,
                          kv_slots: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None) -> torch.Tensor:
    # The interface of kernels.prefill_attention (drop-in): q: [total_q, num_heads, head_dim];
    # k, v: [total_q, num_kv_heads, head_dim], already stored in the cache;
    # k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] -> [total_q, num_heads, head_dim]
    paged = block_tables is not None
    if not fa4_fits(q, k_cache, paged):
        return prefill_attention(q, k, v, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, block_tables, scale, kv_slots, k_scale, v_scale)
    if not paged:   # no cached prefix: the new K/V are all the keys
        out, _ = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                        softmax_scale=scale, causal=True)
        return out
    # seqused_k: [num_seqs] int32 keys per sequence (FA4 takes page_table with seqused_k, not
    # cu_seqlens_k). block_tables rows are padded with -1 past a sequence's last block; FA4 reads
    # page-table entries only below seqused_k.
    seqused_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    out, _ = flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
                                    max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                    page_table=block_tables, softmax_scale=scale, causal=True)
    return out
