import torch
from torch import nn

from nanovllm.kernels import paged_decode_attention, prefill_attention, store_kvcache
from nanovllm.utils.context import get_context


class Attention(nn.Module):
    """Writes the new tokens' K/V into the paged cache (through slot_mapping), then attends over
    the cache: prefill (possibly after a cached prefix or earlier chunks) or one-token decode.
    The back end (flash-attn, Triton, torch) is chosen once, in nanovllm.kernels."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        # Bound by the ModelRunner to this layer's slice of the cache:
        # [num_blocks, block_size, num_kv_heads, head_dim]. Empty during the warm-up run.
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        ctx = get_context()
        if self.k_cache.numel():
            store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        if ctx.is_prefill:
            return prefill_attention(q, k, v, self.k_cache, self.v_cache, ctx.cu_seqlens_q, ctx.cu_seqlens_k,
                                     ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.block_tables, self.scale)
        return paged_decode_attention(q, self.k_cache, self.v_cache, ctx.block_tables, ctx.context_lens, self.scale)
