import torch
from torch import nn

from nanovllm.kernels import paged_decode_attention, prefill_attention, qk_norm_rope_store
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.utils.context import get_context


class Attention(nn.Module):
    """From the qkv projection to the attention output: per-head q/k RMSNorm (Qwen3), rotary and
    the new tokens' K/V write into the paged cache (through slot_mapping), then attention over the
    cache: prefill (possibly after a cached prefix or earlier chunks) or one-token decode.
    The back end (Triton, torch) is chosen once, in nanovllm.kernels; on CUDA the norms, rotary and
    store are one fused kernel."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        # Bound by the ModelRunner to this layer's slice of the cache:
        # [num_blocks, block_size, num_kv_heads, head_dim]. Empty during the warm-up run.
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor, rotary_emb: RotaryEmbedding,
                q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None) -> torch.Tensor:
        # qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim] -> [num_tokens, num_heads, head_dim]
        ctx = get_context()
        if q_norm is None:
            q_weight, k_weight, eps = None, None, 0.0
        else:
            q_weight, k_weight, eps = q_norm.weight, k_norm.weight, q_norm.eps
        q, k, v = qk_norm_rope_store(qkv, q_weight, k_weight, eps, rotary_emb.cos_sin_cache, positions,
                                     ctx.slot_mapping, self.k_cache, self.v_cache,
                                     self.num_heads, self.num_kv_heads, self.head_dim)
        if ctx.is_prefill:
            return prefill_attention(q, k, v, self.k_cache, self.v_cache, ctx.cu_seqlens_q, ctx.cu_seqlens_k,
                                     ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.block_tables, self.scale,
                                     ctx.kv_slots)
        return paged_decode_attention(q, self.k_cache, self.v_cache, ctx.block_tables, ctx.context_lens,
                                      self.scale)
