"""The attention interface: one back-end object with one entry point,

    backend.forward(q, k, v, layer, meta) -> [num_tokens, num_heads, head_dim]

layer: the Attention layer, which carries what is its own (scale, sliding window, logit softcap, the
paged K/V cache and an FP8 cache's scales); meta: the step's attention metadata (utils/context.Context:
prefill or decode, cu_seqlens, block tables, context lengths), built once a step by the ModelRunner.
A new attention feature is a field of the layer or of the metadata that the back end reads, not
another argument threaded through every caller. The back end is chosen in one place,
layers/prefill_attention.select_prefill_attention (Config.prefill_attention), which names the
prefill kernel; decode always runs the paged decode kernel (Triton on CUDA, the torch reference
elsewhere). A layer with a window or a softcap takes masked_prefill_kernel's for its prefills (the
Triton kernel on CUDA, or the torch reference), since FlashAttention-2/-4's wrappers pass neither.
"""
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from nanovllm.kernels import KERNELS, paged_decode_attention, prefill_attention
from nanovllm.utils.context import Context


class AttentionLayer(Protocol):
    """What a back end reads from a layer."""
    scale: float
    sliding_window: int   # 0: full attention; else keys more than window - 1 positions back are masked
    logit_softcap: float  # 0: none; else scores s -> cap * tanh(s / cap) before the softmax
    k_cache: torch.Tensor   # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None   # [1] fp32 for an FP8 cache, else None
    v_scale: torch.Tensor | None


@dataclass(frozen=True)
class AttentionBackend:
    prefill_kernel: Callable = prefill_attention   # kernels.prefill_attention's interface

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                meta: Context) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim], already
        # stored in layer's cache -> [num_tokens, num_heads, head_dim]
        masks = dict(window=layer.sliding_window, softcap=layer.logit_softcap)
        cache = (layer.k_cache, layer.v_cache)
        if not meta.is_prefill:
            return paged_decode_attention(q, *cache, meta.block_tables, meta.context_lens, layer.scale,
                                          layer.k_scale, layer.v_scale, meta.decode_order, **masks)
        args = (q, k, v, *cache, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
                meta.block_tables, layer.scale, meta.kv_slots, layer.k_scale, layer.v_scale)
        if layer.sliding_window or layer.logit_softcap:
            return masked_prefill_kernel(q, layer.k_cache)(*args, **masks)
        return self.prefill_kernel(*args)


def masked_prefill_kernel(q: torch.Tensor, k_cache: torch.Tensor) -> Callable:
    """The prefill kernel of a layer with a window or a softcap: the Triton kernel on CUDA where it
    fits, else kernels.prefill_attention (the torch reference for these layers)."""
    if q.is_cuda and KERNELS != "torch":
        from nanovllm.kernels.triton_prefill import fits, prefill_attention_triton
        if fits(q, k_cache):
            return prefill_attention_triton
    return prefill_attention


DEFAULT_BACKEND = AttentionBackend()   # a layer's until the ModelRunner binds the engine's choice
