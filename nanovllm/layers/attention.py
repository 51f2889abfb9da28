import re
from contextlib import contextmanager

import torch
from torch import nn

import nanovllm.envs as envs
from nanovllm.kernels import qk_norm_rope_store
from nanovllm.kernels.reference import store_kvcache_ref
from nanovllm.layers.attention_backend import DEFAULT_BACKEND
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.utils.context import get_context

# calculate_kv_scales: scale = amax / these, vLLM's defaults (K_SCALE_CONSTANT, V_SCALE_CONSTANT):
# the first prefill's largest |K| is stored as 200 and |V| as 100, headroom below e4m3's 448 for
# larger values later.
K_SCALE_DIVISOR, V_SCALE_DIVISOR = 200.0, 100.0
# The warm-up forward runs before the KV cache exists. With this on, every layer meanwhile stores
# into one dummy block at slot -1 (which writes nothing), so the q/k norm + rotary + store kernel
# compiles there the variant every later step runs (the store on) instead of one of its own with
# the store off: one compile less at a cold start-up (0.6B on an H100, with PARALLEL_COMPILE:
# 6.8 s against 7.1; `benchmarks/startup_compiles.py --set
# NANOVLLM_STORE_AT_WARM_UP=0` times it off).
STORE_AT_WARM_UP = envs.STORE_AT_WARM_UP.get()


class Attention(nn.Module):
    """From the qkv projection to the attention output: per-head q/k RMSNorm (Qwen3), rotary and
    the new tokens' K/V write into the paged cache (through slot_mapping), then attention over the
    cache: prefill (possibly after a cached prefix or earlier chunks) or one-token decode, through
    the attention back end (layers/attention_backend.py; the ModelRunner binds the engine's to
    backend). The kernels (Triton, torch) are chosen once, in nanovllm.kernels; on CUDA the norms,
    rotary and store are one fused kernel.
    sliding_window > 0: each query sees only the last sliding_window keys (itself included);
    logit_softcap > 0: scores s become cap * tanh(s / cap) before the softmax (Gemma 2)."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 sliding_window: int = 0, logit_softcap: float = 0.0):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.sliding_window, self.logit_softcap = int(sliding_window or 0), float(logit_softcap or 0.0)
        # Bound by the ModelRunner to this layer's slice of the cache:
        # [num_blocks, block_size, num_kv_heads, head_dim]. Empty during the warm-up run.
        self.k_cache = self.v_cache = torch.tensor([])
        # An FP8 cache's scales, [1] fp32 on the cache's device (bound by the ModelRunner; 1.0 or the
        # checkpoint's static scales, unless calculate_kv_scales sets them at the first prefill).
        self.k_scale = self.v_scale = None
        self.calculate_kv_scales = False
        self.backend = DEFAULT_BACKEND

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor, rotary_emb: RotaryEmbedding,
                q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None,
                norm_of: torch.Tensor | None = None, norm_eps: float = 0.0) -> torch.Tensor:
        # qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim] -> [num_tokens, num_heads, head_dim]
        # norm_of: [num_tokens, hidden], qkv_proj's input when the RMSNorm before it was folded into
        # its weight: q, k, v are first scaled by its rows' rstd (eps norm_eps)
        ctx = get_context()
        scale_rows = dict(norm_of=norm_of, norm_eps=norm_eps)
        if q_norm is None:
            q_weight, k_weight, eps = None, None, 0.0
        else:
            q_weight, k_weight, eps = q_norm.weight, k_norm.weight, q_norm.eps
        if self.calculate_kv_scales and ctx.is_prefill and self.k_cache.numel():
            q, k, v = self.store_with_new_scales(qkv, q_weight, k_weight, eps, rotary_emb, positions, ctx,
                                                 scale_rows)
        else:
            q, k, v = qk_norm_rope_store(qkv, q_weight, k_weight, eps, rotary_emb.cos_sin_cache, positions,
                                         ctx.slot_mapping, self.k_cache, self.v_cache, self.num_heads,
                                         self.num_kv_heads, self.head_dim, self.k_scale, self.v_scale,
                                         **scale_rows)
        return self.backend.forward(q, k, v, self, ctx)

    def store_with_new_scales(self, qkv, q_weight, k_weight, eps, rotary_emb, positions, ctx, scale_rows):
        """Once, at the first prefill into the cache: the scales from this batch's largest |K| and
        |V| (on the device, no sync), then the store with them (the torch store: a one-off)."""
        empty = torch.tensor([], device=qkv.device)
        q, k, v = qk_norm_rope_store(qkv, q_weight, k_weight, eps, rotary_emb.cos_sin_cache, positions,
                                     None, empty, empty, self.num_heads, self.num_kv_heads, self.head_dim,
                                     **scale_rows)
        for scale, x, divisor in ((self.k_scale, k, K_SCALE_DIVISOR), (self.v_scale, v, V_SCALE_DIVISOR)):
            amax = x.abs().amax().float()
            scale.copy_(torch.where(amax > 0, amax / divisor, 1.0))   # all zeros: keep 1.0, not 0
        store_kvcache_ref(k, v, self.k_cache, self.v_cache, ctx.slot_mapping, self.k_scale, self.v_scale)
        self.calculate_kv_scales = False
        return q, k, v


# A checkpoint's static KV cache scales (loaded into model.kv_scale_tensors by utils/loader.py): layer
# i's K and V scale, one scalar each (AutoFP8's k/v_proj.output_scale; llm-compressor's k_scale /
# v_scale; the older kv_scale, both).
_KV_SCALE_NAME = re.compile(r"layers\.(\d+)\.self_attn\.(?:([kv])_proj\.output_scale|([kv]|kv)_scale)$")


def kv_scale_rows(model: nn.Module, num_layers: int) -> torch.Tensor:
    """[2 (k, v), num_layers, 4] fp32 (CPU) for the ModelRunner's FP8 cache scales, each layer's in
    column 0: 1.0, or the checkpoint's static scale where it has one (as vLLM uses them)."""
    rows = torch.ones(2, num_layers, 4)
    for name, tensor in getattr(model, "kv_scale_tensors", {}).items():
        if (m := _KV_SCALE_NAME.search(name)) is None:
            if name.endswith(".output_scale"):
                continue   # another projection's output_scale (q_proj, o_proj)
            raise ValueError(f"checkpoint tensor {name!r}: a KV cache scale nanovllm does not know where "
                             "to put (expected layers.N.self_attn.k_scale / v_scale / kv_scale or "
                             "k_proj / v_proj.output_scale)")
        layer, value = int(m[1]), tensor.float().reshape(-1)
        if layer >= num_layers or value.numel() != 1 or not 0 < value.item() < float("inf"):
            raise ValueError(f"checkpoint tensor {name!r} ({tensor.tolist()}): a KV cache scale is one "
                             f"positive finite number for one of the model's {num_layers} layers")
        for kind in m[2] or m[3]:
            rows["kv".index(kind), layer, 0] = value.item()
    return rows


@contextmanager
def warm_up_store(layers: list[Attention], block_size: int, kv_dtype: torch.dtype, device: torch.device):
    """Within (when STORE_AT_WARM_UP): every layer's cache is one zeroed block of kv_dtype (its
    scales 1.0, a tensor of their own and so 16-byte aligned as the real ones, for an FP8 cache);
    the layers' own after."""
    if not STORE_AT_WARM_UP or not layers:
        yield
        return
    attn = layers[0]
    block = torch.zeros(1, block_size, attn.num_kv_heads, attn.head_dim, dtype=kv_dtype, device=device)
    scale = torch.ones(1, device=device)
    saved = [(layer.k_cache, layer.v_cache, layer.k_scale, layer.v_scale) for layer in layers]
    for layer in layers:
        layer.k_cache = layer.v_cache = block
        if kv_dtype == torch.float8_e4m3fn:
            layer.k_scale = layer.v_scale = scale
    try:
        yield
    finally:
        for layer, (k, v, k_scale, v_scale) in zip(layers, saved):
            layer.k_cache, layer.v_cache, layer.k_scale, layer.v_scale = k, v, k_scale, v_scale
