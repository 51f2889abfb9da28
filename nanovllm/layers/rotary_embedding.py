import weakref

import torch
from torch import nn

from nanovllm.kernels.reference import apply_rotary_ref


def _inv_freq(head_dim: int, base: float, rope_scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    if rope_type == "linear":   # positions divided by factor (Gemma 3's global layers)
        return inv_freq / rope_scaling["factor"]
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.x: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * torch.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, blended, out)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate_half), cos/sin cached for every position in fp32."""

    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None):
        super().__init__()
        inv_freq = _inv_freq(head_dim, base, rope_scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        # cos_sin_cache: [max_position, head_dim] = cos half | sin half
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # positions: [num_tokens]; q: [num_tokens, num_heads, head_dim];
        # k: [num_tokens, num_kv_heads, head_dim]
        return apply_rotary_ref(positions, q, k, self.cos_sin_cache)


# Held weakly: an entry (its cos/sin table is on the model's device) lives as long as a model uses it.
_ROPES: "weakref.WeakValueDictionary[tuple, RotaryEmbedding]" = weakref.WeakValueDictionary()


def get_rope(head_dim: int, max_position: int, base: float,
             rope_scaling: dict | None = None) -> RotaryEmbedding:
    """One shared RotaryEmbedding per setting and device: all layers of a model use the same one."""
    scaling = tuple(sorted(rope_scaling.items())) if rope_scaling else None
    device = torch.get_default_device()
    key = (head_dim, max_position, float(base), scaling, device)
    rope = _ROPES.get(key)
    if rope is None:
        with device:
            rope = RotaryEmbedding(head_dim, max_position, float(base), dict(scaling) if scaling else None)
        _ROPES[key] = rope
    return rope
