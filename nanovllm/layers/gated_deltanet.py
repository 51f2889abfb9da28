"""Gated DeltaNet, the linear-attention layer of Qwen3.5 / Qwen3.6: projections to q, k, v (through a
short causal conv), z (the output gate), b (beta) and a (the decay); the gated delta rule over a
fixed-size recurrent state per sequence; a gated RMSNorm; the output projection.

State per sequence (SequenceStateLayer): the conv state, the last conv_kernel - 1 conv inputs
([conv_channels, kernel - 1], the model's dtype), and the recurrent state ([v_heads, k_dim, v_dim],
fp32, as fla-core keeps it). A prefill from position 0 (no tokens before it in the context) starts
from zeros, whatever its slot held: the slot's rows are read only after.

Tensor parallelism: each rank holds num_k_heads / tp key heads and num_v_heads / tp value heads (the
value heads of a key head stay with it), so q, k, v, z, b, a, the conv channels and the states are
all split by heads; out_proj is row-parallel (one all-reduce).

Kernels: fla-core's chunk / fused-recurrent gated delta rule on CUDA when it is installed, else the
torch reference (kernels/linear_attention_ref.py). The conv is torch on every device."""
import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from nanovllm.kernels.linear_attention_ref import (causal_conv_step, causal_conv_varlen,
                                                   gated_delta_rule_step, gated_delta_rule_varlen,
                                                   gated_rms_norm)
from nanovllm.layers.linear import ColumnParallelLinear, RowParallelLinear, _divide, _shard
from nanovllm.layers.sequence_state import SequenceStateLayer, StateSpec
from nanovllm.parallel.parallel_state import tp_rank, tp_size
from nanovllm.utils.context import get_context
from nanovllm.utils.loader import default_weight_loader

logger = logging.getLogger(__name__)

@functools.cache
def fla_kernels():
    """fla-core's (chunk, fused_recurrent) gated delta rule, or None where it is not installed (an
    optional dependency, imported on first use: only CUDA runs it)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def log_delta_rule_kernels(device: torch.device):
    """One line at model build on CUDA: which delta-rule kernels run."""
    if device.type != "cuda":
        return
    if fla_kernels() is None:
        logger.warning("fla-core is not installed: the linear-attention layers run the torch reference "
                       "(slow; `pip install fla-core` for its kernels)")
    else:
        logger.info("linear attention: fla-core's gated delta rule kernels")


def load_parts(dest: torch.Tensor, loaded: torch.Tensor, sizes: list[int], rank: int, world: int):
    """Copy this rank's share of a checkpoint tensor made of parts of the given sizes along dim 0,
    each part split over the ranks on its own, into dest (the parts' shares back to back)."""
    if loaded.size(0) != sum(sizes):
        raise ValueError(f"shape mismatch: checkpoint tensor {tuple(loaded.shape)} should have "
                         f"{sum(sizes)} rows")
    offset = 0
    for part in loaded.split(sizes):
        share = part.size(0) // world
        default_weight_loader(dest.narrow(0, offset, share), _shard(part, 0, share, rank, world))
        offset += share


class PartsColumnParallelLinear(ColumnParallelLinear):
    """Several checkpoint tensors in one column-parallel matrix, each made of parts (q | k | v) that
    are split over the ranks one by one. parts: shard id -> its tensor's part sizes, in packed order.
    groups (Qwen3-Next's one fused tensor, no shard id): (number of key heads, the rows each key head
    has of every part, in parts' order), the parts interleaved key head by key head."""

    def __init__(self, input_size: int, parts: dict[str, list[int]],
                 groups: tuple[int, list[int]] | None = None):
        self.parts, self.groups = parts, groups
        super().__init__(input_size, sum(sum(sizes) for sizes in parts.values()))

    def checkpoint_rows(self, shard_id: str | None = None) -> int:
        """The rows of checkpoint tensor shard_id (None: the fused one), all ranks'. The loader regroups
        rows by part (and de-interleaves them by key head), so what is stored per row (an FP8 scale)
        goes through it (quantization/fp8_methods.py)."""
        parts = self.parts.values() if shard_id is None else [self.parts[shard_id]]
        return sum(sum(sizes) for sizes in parts)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None):
        if shard_id is None:
            return self._load_grouped(param, loaded)
        offset = 0
        for name, sizes in self.parts.items():
            if name == shard_id:
                break
            offset += sum(sizes) // self.tp_size
        size = sum(self.parts[shard_id]) // self.tp_size
        load_parts(param.data.narrow(0, offset, size), loaded, self.parts[shard_id], self.tp_rank,
                   self.tp_size)

    def _load_grouped(self, param: nn.Parameter, loaded: torch.Tensor):
        if self.groups is None:
            raise ValueError(f"a fused checkpoint tensor {tuple(loaded.shape)} where separate ones "
                             f"({', '.join(self.parts)}) are expected")
        num_groups, rows = self.groups
        if loaded.size(0) != num_groups * sum(rows):
            raise ValueError(f"shape mismatch: checkpoint tensor {tuple(loaded.shape)} should have "
                             f"{num_groups * sum(rows)} rows")
        # [groups * sum(rows), ...] -> each part's rows of all groups, back to back
        split = [p.flatten(0, 1) for p in loaded.unflatten(0, (num_groups, sum(rows))).split(rows, dim=1)]
        for shard_id, sizes in self.parts.items():
            self.weight_loader(param, torch.cat(split[:len(sizes)]), shard_id)
            split = split[len(sizes):]


class DepthwiseConv(nn.Module):
    """The causal conv's weight, [channels / tp, kernel] (the checkpoint's [channels, 1, kernel]),
    its channels q | k | v split over the ranks part by part."""

    def __init__(self, parts: list[int], kernel: int):
        super().__init__()
        self.parts, self.tp_rank, self.tp_size = parts, tp_rank(), tp_size()
        self.weight = nn.Parameter(torch.empty(sum(parts) // self.tp_size, kernel))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        load_parts(param.data, loaded.flatten(1), self.parts, self.tp_rank, self.tp_size)


def _head_split(param: nn.Parameter, loaded: torch.Tensor):
    """A [num_v_heads] vector split over the ranks."""
    default_weight_loader(param, _shard(loaded, 0, param.size(0), tp_rank(), tp_size()))


class GatedRMSNorm(nn.Module):
    """RMSNorm per value head, times silu(z) (a plain weight, not zero-centred)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # x, gate: [num_tokens, v_heads, v_dim]
        return gated_rms_norm(x, gate, self.weight, self.eps)


class GatedDeltaNet(SequenceStateLayer):
    """fused_projections: the checkpoint has Qwen3-Next's in_proj_qkvz and in_proj_ba, each key
    head's q, k, v, z (and b, a) rows together, rather than Qwen3.5's in_proj_qkv, _z, _b, _a."""

    def __init__(self, config: PretrainedConfig, fused_projections: bool = False):
        super().__init__()
        tp = tp_size()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        num_k, num_v = config.linear_num_key_heads, config.linear_num_value_heads
        if num_v % num_k:
            raise ValueError(f"linear_num_value_heads ({num_v}) must be a multiple of linear_num_key_heads "
                             f"({num_k})")
        self.num_k_heads = _divide(num_k, tp, "linear_num_key_heads")
        self.num_v_heads = _divide(num_v, tp, "linear_num_value_heads")
        self.k_dim, self.v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.kernel = config.linear_conv_kernel_dim
        key_dim, value_dim = num_k * self.k_dim, num_v * self.v_dim
        r = num_v // num_k   # value heads per key head
        self.in_proj_qkvz = PartsColumnParallelLinear(
            config.hidden_size, {"qkv": [key_dim, key_dim, value_dim], "z": [value_dim]},
            (num_k, [self.k_dim, self.k_dim, r * self.v_dim, r * self.v_dim]) if fused_projections else None)
        self.in_proj_ba = PartsColumnParallelLinear(config.hidden_size, {"b": [num_v], "a": [num_v]},
                                                    (num_k, [r, r]) if fused_projections else None)
        self.conv1d = DepthwiseConv([key_dim, key_dim, value_dim], self.kernel)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.A_log.weight_loader = self.dt_bias.weight_loader = _head_split
        self.norm = GatedRMSNorm(self.v_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(value_dim, config.hidden_size)

    def state_specs(self, dtype: torch.dtype) -> dict[str, StateSpec]:
        conv_channels = 2 * self.num_k_heads * self.k_dim + self.num_v_heads * self.v_dim
        return {"conv": StateSpec((conv_channels, self.kernel - 1), dtype),
                "recurrent": StateSpec((self.num_v_heads, self.k_dim, self.v_dim), torch.float32)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden] -> [num_tokens, hidden]
        ctx = get_context()
        hk, hv = self.num_k_heads * self.k_dim, self.num_v_heads * self.v_dim
        mixed, z = self.in_proj_qkvz(x).split([2 * hk + hv, hv], dim=-1)
        b, a = self.in_proj_ba(x).chunk(2, dim=-1)
        beta = b.sigmoid()                                                  # [num_tokens, v_heads]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)   # log decay, <= 0
        slots = ctx.state_slots
        conv_state, rec_state = self._read_states(slots, ctx, x)
        if ctx.is_prefill:
            mixed, conv_state = causal_conv_varlen(mixed, self.conv1d.weight, conv_state, ctx.cu_seqlens_q)
        else:
            mixed, conv_state = causal_conv_step(mixed, self.conv1d.weight, conv_state)
        q, k, v = mixed.split([hk, hk, hv], dim=-1)
        q = q.view(-1, self.num_k_heads, self.k_dim)
        k = k.view(-1, self.num_k_heads, self.k_dim)
        v = v.view(-1, self.num_v_heads, self.v_dim)
        out, rec_state = self._delta_rule(q, k, v, g, beta, rec_state, ctx)
        if slots is not None:
            self.states["conv"][slots] = conv_state.to(self.states["conv"].dtype)
            self.states["recurrent"][slots] = rec_state
        out = self.norm(out, z.view_as(out))
        return self.out_proj(out.flatten(1))

    def _read_states(self, slots, ctx, x) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequences' conv and recurrent states ([num_seqs, ...] copies): zeros for a sequence
        whose prefill starts at position 0, and for all when no slots are bound (the warm-up run)."""
        if slots is None:
            num_seqs = ctx.cu_seqlens_q.numel() - 1 if ctx.is_prefill else x.shape[0]
            return tuple(torch.zeros(num_seqs, *spec.shape, dtype=spec.dtype, device=x.device)
                         for spec in self.state_specs(x.dtype).values())
        conv, rec = self.states["conv"][slots], self.states["recurrent"][slots]
        if ctx.is_prefill:   # no tokens before this chunk: its keys are all new
            fresh = (ctx.cu_seqlens_k.diff() == ctx.cu_seqlens_q.diff())[:, None, None]
            conv, rec = conv.masked_fill(fresh, 0), rec.masked_fill(fresh[..., None], 0)
        return conv, rec

    def _delta_rule(self, q, k, v, g, beta, state, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        # q, k: [num_tokens, k_heads, k_dim]; v: [num_tokens, v_heads, v_dim]; g, beta: [num_tokens,
        # v_heads]; state: [num_seqs, v_heads, k_dim, v_dim] fp32 -> (o like v, new state fp32)
        if q.is_cuda and fla_kernels() is not None:
            return self._delta_rule_fla(q, k, v, g, beta, state, ctx)
        if ctx.is_prefill:
            return gated_delta_rule_varlen(q, k, v, g, beta, state, ctx.cu_seqlens_q.tolist())
        return gated_delta_rule_step(q, k, v, g, beta, state)

    @staticmethod
    def _delta_rule_fla(q, k, v, g, beta, state, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        # fla takes [batch, tokens, heads, dim]: prefill one batch row of varlen sequences, decode
        # one row per sequence (graph-safe: no host sync); g in fp32 and beta in the model's dtype,
        # as transformers passes them.
        chunk_gated_delta_rule, fused_recurrent_gated_delta_rule = fla_kernels()
        args = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()   # views of the conv's output
        if ctx.is_prefill:
            o, new = chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                            cu_seqlens=ctx.cu_seqlens_q.long(), **args)
            return o[0], new.float()
        o, new = fused_recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None],
                                                  beta=beta[:, None], **args)
        return o[:, 0], new.float()
