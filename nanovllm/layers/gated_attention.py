"""The full-attention layer of Qwen3.5 / Qwen3-Next: Qwen3's attention (per-head q/k RMSNorm, rotary,
paged KV cache) with an output gate (q_proj makes each head's query and its gate: o * sigmoid(gate))
and partial rotary (only the first rotary_dim = head_dim * partial_rotary_factor dims of each head
rotate, in pairs (i, i + rotary_dim / 2)).

Partial rotary runs through the same full-width rotary (pairs (i, i + head_dim / 2)) as every other
model, so the fused q/k norm + rotary + KV-store kernel serves it unchanged: at load, each q and k
head's dims are reordered (`rotary_order`) so that the rotated pairs sit at (i, i + head_dim / 2),
and the cos/sin table gives the other dims frequency 0 (cos 1, sin 0: they pass through exactly).
Attention scores are dot products of q and k, which the same reordering of both leaves unchanged;
v and the output are not reordered; the per-head RMSNorm's weights are reordered with their dims."""
import weakref

import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.attention import Attention
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import ColumnParallelLinear, RowParallelLinear, _divide, _shard
from nanovllm.parallel.parallel_state import tp_size
from nanovllm.utils.loader import default_weight_loader


def rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """[head_dim] int64: new dim i holds old dim order[i]. Old dims [0, r/2) stay, [r/2, r) move to
    [head_dim/2, head_dim/2 + r/2), and the pass-through dims fill the rest in order."""
    half, r2 = head_dim // 2, rotary_dim // 2
    order = torch.empty(head_dim, dtype=torch.int64)
    order[:r2] = torch.arange(r2)
    order[half:half + r2] = torch.arange(r2, rotary_dim)
    rest = torch.cat([torch.arange(r2, half), torch.arange(half + r2, head_dim)])
    order[rest] = torch.arange(rotary_dim, head_dim)
    return order


class PartialRotary(nn.Module):
    """cos/sin for rotary_order's dims: [max_position, head_dim] = cos half | sin half, frequencies
    1 / theta ** (2i / rotary_dim) for i < rotary_dim / 2, then 0 (as transformers computes them)."""

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, theta: float):
        super().__init__()
        inv_freq = torch.zeros(head_dim // 2, dtype=torch.float32)   # fp32 whatever the default dtype
        inv_freq[:rotary_dim // 2] = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)


# One table per setting and device, shared by all layers (262144 positions x 256 dims of fp32 are
# 256 MiB); held weakly, as layers/rotary_embedding.py's get_rope holds its own.
_TABLES: "weakref.WeakValueDictionary[tuple, PartialRotary]" = weakref.WeakValueDictionary()


def get_partial_rope(head_dim: int, rotary_dim: int, max_position: int, theta: float) -> PartialRotary:
    key = (head_dim, rotary_dim, max_position, float(theta), torch.get_default_device())
    rope = _TABLES.get(key)
    if rope is None:
        rope = _TABLES[key] = PartialRotary(head_dim, rotary_dim, max_position, theta)
    return rope


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rotary_of(config: PretrainedConfig) -> tuple[float, int]:
    """(theta, rotary_dim) from rope_parameters (transformers 5) or the older attributes; only the
    default rope (multimodal mrope sections coincide with it for text positions)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported for {type(config).__name__} "
                         "(only 'default')")
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    head_dim = head_dim_of(config)
    rotary_dim = int(head_dim * factor)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"partial_rotary_factor {factor} gives {rotary_dim} rotary dims of head_dim "
                         f"{head_dim}: it must give an even number > 0")
    return theta, rotary_dim


class GatedQKVParallelLinear(ColumnParallelLinear):
    """q_proj (per head: its query rows, then its gate rows), k_proj and v_proj in one matrix. Each rank's
    output is q | k | v | gate of its heads (q | k | v as Attention takes it); q and k rows in
    rotary_order within each head."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 order: torch.Tensor):
        tp = tp_size()
        self.head_dim, self.order = head_dim, order
        self.num_heads = _divide(num_heads, tp, "number of attention heads")
        self.num_kv_heads = _divide(num_kv_heads, tp, "number of KV heads")
        super().__init__(hidden_size, (2 * num_heads + 2 * num_kv_heads) * head_dim, bias)

    def checkpoint_rows(self, shard_id: str) -> int:
        """The rows of checkpoint tensor shard_id (whole, all ranks'). The loader below moves rows
        within and across heads, so what is stored per row (an FP8 scale, a LoRA B) goes through it
        (quantization/fp8_methods.py, lora/layers.py)."""
        heads = 2 * self.num_heads if shard_id == "q" else self.num_kv_heads
        return heads * self.tp_size * self.head_dim

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str):
        d, h, kv = self.head_dim, self.num_heads, self.num_kv_heads
        if shard_id == "q":   # [heads * 2 * d, ...] -> query rows at 0, gate rows after v
            heads = _shard(loaded, 0, 2 * h * d, self.tp_rank, self.tp_size).unflatten(0, (h, 2, d))
            parts = [(0, heads[:, 0][:, self.order]), ((h + 2 * kv) * d, heads[:, 1])]
        else:
            heads = _shard(loaded, 0, kv * d, self.tp_rank, self.tp_size).unflatten(0, (kv, d))
            parts = [(h * d, heads[:, self.order])] if shard_id == "k" else [((h + kv) * d, heads)]
        for offset, rows in parts:
            rows = rows.flatten(0, 1)
            default_weight_loader(param.data.narrow(0, offset, rows.size(0)), rows)


def qk_norm(size: int, eps: float, order: torch.Tensor) -> RMSNorm:
    """A per-head q or k norm whose checkpoint weight w scales by 1 + w (layers/zero_centred_norm.py),
    as a plain RMSNorm of weight 1 + w (its dims in rotary_order), so that the fused q/k norm + rotary
    + KV-store kernel runs it. 1 + w is stored in the model's dtype: in bf16 it is rounded once."""
    norm = RMSNorm(size, eps)

    def load(param: nn.Parameter, loaded: torch.Tensor):
        default_weight_loader(param, (loaded.float() + 1.0)[order])
    norm.weight.weight_loader = load
    return norm


class GatedAttention(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        hidden, d = config.hidden_size, head_dim_of(config)
        theta, rotary_dim = rotary_of(config)
        order = rotary_order(d, rotary_dim)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = GatedQKVParallelLinear(hidden, d, config.num_attention_heads,
                                               config.num_key_value_heads, bias, order)
        h, kv = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.qkv_size, self.gate_size = (h + 2 * kv) * d, h * d
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, hidden, bias=bias)
        self.rotary_emb = get_partial_rope(d, rotary_dim, config.max_position_embeddings, theta)
        self.attn = Attention(h, d, d ** -0.5, kv)
        self.q_norm = qk_norm(d, config.rms_norm_eps, order)
        self.k_norm = qk_norm(d, config.rms_norm_eps, order)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden] -> [num_tokens, hidden]
        qkv, gate = self.qkv_proj(x).split([self.qkv_size, self.gate_size], dim=-1)
        out = self.attn(positions, qkv, self.rotary_emb, self.q_norm, self.k_norm)   # [tokens, heads, d]
        return self.o_proj(out.flatten(1) * torch.sigmoid(gate))
