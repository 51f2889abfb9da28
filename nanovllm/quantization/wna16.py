"""Integer weights with 16-bit activations (W4A16, W8A16: GPTQ, AWQ, compressed-tensors pack-quantized)
on the linear layers and the experts. A format is a Layout (gptq.py, awq.py, compressed_tensors.py):
the checkpoint tensors beside each projection, how each one shards, and how they turn into the one
packed form of kernels/wna16_reference.py after loading:

  w_packed [K / p, N] int32 (packed along K), w_scales [G, N] float32, w_zeros [G, N] int32,
  w_g_idx [K] int32 or None (act order: the group of each input row, else row // group_size)

(the experts: the same with a leading [num_experts], w13_* and w2_*). apply dequantizes W exactly
(float32, rounded once to the activations' dtype) and runs the float GEMM, so the CPU path computes
what transformers computes on the dequantized model.

Tensor parallelism shards each tensor along its output axis with the layer's rows (a packed word
covers p output columns, so a shard or packed projection must start and end on one) and along its
input axis with a row-parallel shard's columns (a whole number of groups, and of words); anything
else is a ValueError naming the sizes. With act order the scales and zero points stay whole on every
rank (a rank's rows may belong to any group) and g_idx is sharded with the rows."""
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels import KERNELS
from nanovllm.layers.fused_moe import FusedMoE, fused_experts
from nanovllm.layers.linear import LinearBase, _shard
from nanovllm.quantization.base import LinearMethod, MoEMethod, QuantizationConfig, empty_param, output_part
from nanovllm.kernels.wna16_reference import dequantize, quantize_symmetric
from nanovllm.utils.loader import CheckpointNames, default_weight_loader, expert_param_suffix

if KERNELS != "torch":
    from nanovllm.kernels.wna16_gemm import wna16_linear

# The most rows the Triton GEMM takes (decode batches, reading W packed); larger ones dequantize W and
# run cuBLAS, where the GEMM's arithmetic outweighs reading W.
DECODE_MAX_ROWS = 64


@dataclass(frozen=True)
class Spec:
    """One checkpoint tensor beside a projection: its shape on this rank, and which axis holds the
    output columns (out_unit of them an entry: 1, or p for a packed word) and the input rows
    (in_unit an entry: 1, p, or group_size), None where the tensor has no such axis or stays whole."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    out_dim: int | None
    out_unit: int
    in_dim: int | None
    in_unit: int
    holds_shape: bool = False   # the projection's whole [N, K] (compressed-tensors' weight_shape): checked
    shared: bool = False        # one tensor for all of a packed layer's projections (g_idx): they must agree


@dataclass(frozen=True)
class Geometry:
    """A weight's shape on this rank, and how its output rows split (the layer's, or an expert's)."""
    n: int
    k: int
    tp_dim: int | None   # 0: the output columns are sharded, 1: the input rows, None: neither
    tp_rank: int
    tp_size: int
    part: Callable[[object], tuple[int, int]]   # shard_id -> (offset, size) of the output rows it fills

    @property
    def k_full(self) -> int:
        return self.k * (self.tp_size if self.tp_dim == 1 else 1)


class Layout:
    """A format's tensors (see the module docstring). bits: 4 or 8; group: input rows per scale
    (None: one per output channel)."""
    bits: int
    group: int | None

    @property
    def pack(self) -> int:
        return 32 // self.bits

    def specs(self, geo: Geometry) -> dict[str, Spec]:
        raise NotImplementedError

    def to_packed(self, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                             torch.Tensor | None]:
        """This rank's tensors of one weight -> (w_packed, w_scales, w_zeros, w_g_idx)."""
        raise NotImplementedError

    def num_groups(self, k: int) -> int:
        return 1 if self.group is None else -(-k // self.group)

    def check(self, geo: Geometry, what: str):
        """Before loading: every size this rank's tensors need is whole."""
        if geo.tp_dim == 1 and geo.tp_size > 1 and self.group is not None and geo.k % self.group:
            raise ValueError(f"{what}: a row-parallel shard's {geo.k} input rows (of {geo.k_full}, "
                             f"tensor_parallel_size {geo.tp_size}) are not a whole number of groups of "
                             f"{self.group} (group_size): choose a tensor_parallel_size that keeps each "
                             "shard a whole number of groups")


@dataclass(frozen=True)
class WNA16Config(QuantizationConfig):
    layout: Layout
    ignore: tuple[str, ...] = ()
    unread: tuple[str, ...] = ()   # suffixes of checkpoint tensors not read (GPTQ's trivial g_idx)

    @property
    def names(self) -> CheckpointNames:
        return CheckpointNames(unread=self.unread)

    def linear_method(self, name: str, layer: LinearBase) -> "WNA16LinearMethod":
        return WNA16LinearMethod(self.layout, name)

    def moe_method(self, name: str, moe: nn.Module) -> "WNA16MoEMethod":
        return WNA16MoEMethod(self.layout, name)


# ---- loading ----------------------------------------------------------------------------------

def _load_shard(geo: Geometry, spec: Spec, name: str, dest: torch.Tensor, loaded: torch.Tensor, shard_id):
    if loaded.is_floating_point() != dest.is_floating_point():
        raise ValueError(f"dtype {loaded.dtype}, but this format's {name} is {dest.dtype}: the checkpoint "
                         "does not match its quantization_config")
    if spec.holds_shape:
        size = geo.part(shard_id)[1] * (geo.tp_size if geo.tp_dim == 0 else 1)
        if loaded.tolist() != [size, geo.k_full]:
            raise ValueError(f"{name} {loaded.tolist()}: the model's projection is [{size}, {geo.k_full}]")
        return
    if spec.out_dim is not None:
        offset, size = geo.part(shard_id)
        u = spec.out_unit
        if size % u or offset % u:
            raise ValueError(f"{name}: a shard or packed projection of {size} output columns (from column "
                             f"{offset}) is not a whole number of {u}-column words: choose a "
                             "tensor_parallel_size that keeps each shard a whole number of them")
        dest = dest.narrow(spec.out_dim, offset // u, size // u)
        world = geo.tp_size if geo.tp_dim == 0 else 1
        loaded = _shard(loaded, spec.out_dim, size // u, geo.tp_rank if world > 1 else 0, world)
    if spec.in_dim is not None and geo.tp_dim == 1 and geo.tp_size > 1:
        u = spec.in_unit
        if geo.k % u:
            raise ValueError(f"{name}: a row-parallel shard's {geo.k} input rows (of {geo.k_full}) are not a "
                             f"whole number of {u}-row groups or words: choose a tensor_parallel_size that "
                             "keeps each shard a whole number of them")
        loaded = _shard(loaded, spec.in_dim, geo.k // u, geo.tp_rank, geo.tp_size)
    if spec.shared and (dest >= 0).any():   # (created as -1: no projection loaded yet)
        if dest.shape != loaded.shape or not torch.equal(dest, loaded.to(dest.dtype)):
            raise ValueError(f"{name} differs between projections that nanovllm packs into one layer "
                             "(q/k/v or gate/up, which share their input and so their act order)")
        return
    default_weight_loader(dest, loaded)


def _linear_geometry(layer: LinearBase) -> Geometry:
    return Geometry(layer.out_features, layer.in_features, layer.tp_dim, layer.tp_rank, layer.tp_size,
                    lambda shard_id: output_part(layer, shard_id))


def _expert_geometries(moe: FusedMoE) -> dict[str, Geometry]:
    """w13: gate rows then up rows (index 0, 1), column-parallel; w2: row-parallel."""
    inter = moe.inter
    return {"w13": Geometry(2 * inter, moe.hidden, 0, moe.tp_rank, moe.tp_size,
                            lambda index: (index * inter, inter)),
            "w2": Geometry(moe.hidden, inter, 1, moe.tp_rank, moe.tp_size, lambda index: (0, moe.hidden))}


class WNA16LinearMethod(LinearMethod):
    def __init__(self, layout: Layout, name: str):
        self.layout, self.name = layout, name

    def create_weights(self, layer: LinearBase):
        geo = _linear_geometry(layer)
        self.layout.check(geo, self.name)
        device = layer.weight.device
        del layer.weight   # the format's tensors take its place
        self.tensor_names = []
        for name, spec in self.layout.specs(geo).items():
            def load(param, loaded, shard_id=None, spec=spec, name=name):
                _load_shard(geo, spec, name, param.data, loaded, shard_id)
            setattr(layer, name, _new_param(spec, (), device, load))
            self.tensor_names.append(name)

    def process_weights_after_loading(self, layer: LinearBase, loaded: bool):
        if loaded:
            tensors = {name: getattr(layer, name).data for name in self.tensor_names}
            for name in self.tensor_names:
                delattr(layer, name)
            packed = self.layout.to_packed(tensors)
        else:   # dummy weights: round to nearest, zero point 2^(bits-1), no act order
            packed = (*quantize_symmetric(layer.weight.data, self.layout.bits, self.layout.group), None)
            del layer.weight
        _set_packed(layer, "w", packed)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None,
              into: torch.Tensor | None = None) -> torch.Tensor:
        if x.is_cuda and KERNELS != "torch" and x.shape[0] <= DECODE_MAX_ROWS:
            y = wna16_linear(x.contiguous(), layer.w_packed, layer.w_scales, layer.w_zeros, layer.w_g_idx,
                             self.layout.bits, self.layout.group)
            y = y if bias is None else y + bias
            return y if into is None else into.add_(y)
        w = dequantize(layer.w_packed, layer.w_scales, layer.w_zeros, layer.w_g_idx, self.layout.bits,
                       self.layout.group, x.dtype)   # [N, K]
        y = F.linear(x, w, bias)
        return y if into is None else into.add_(y)


class WNA16MoEMethod(MoEMethod):
    def __init__(self, layout: Layout, name: str):
        self.layout, self.name = layout, name

    def create_weights(self, moe: FusedMoE):
        device = moe.w13.device
        del moe.w13, moe.w2
        self.tensor_names = {"w13": [], "w2": []}
        for stacked, geo in _expert_geometries(moe).items():
            self.layout.check(geo, f"{self.name}.{stacked}")
            for name, spec in self.layout.specs(geo).items():
                def load(param, loaded, shard_id, spec=spec, name=name, geo=geo):
                    expert, index = shard_id
                    if not 0 <= expert < param.shape[0]:
                        raise ValueError(f"expert {expert} is past the config's num_experts "
                                         f"({param.shape[0]})")
                    _load_shard(geo, spec, name, param.data[expert], loaded, index)
                setattr(moe, f"{stacked}{expert_param_suffix(name)}",
                        _new_param(spec, (moe.num_experts,), device, load))
                self.tensor_names[stacked].append(name)

    def process_weights_after_loading(self, moe: FusedMoE, loaded: bool):
        for stacked in ("w13", "w2"):
            per_expert = []
            for e in range(moe.num_experts):
                if loaded:
                    tensors = {n: getattr(moe, f"{stacked}{expert_param_suffix(n)}").data[e]
                               for n in self.tensor_names[stacked]}
                    per_expert.append(self.layout.to_packed(tensors))
                else:
                    per_expert.append((*quantize_symmetric(getattr(moe, stacked).data[e], self.layout.bits,
                                                           self.layout.group), None))
            if loaded:
                for name in self.tensor_names[stacked]:
                    delattr(moe, f"{stacked}{expert_param_suffix(name)}")
            else:
                delattr(moe, stacked)
            stacked_parts = [torch.stack(p) if p[0] is not None else None for p in zip(*per_expert)]
            _set_packed(moe, stacked, stacked_parts)

    def _weights(self, moe: FusedMoE, stacked: str, dtype: torch.dtype) -> torch.Tensor:
        q, s, z, g = (getattr(moe, f"{stacked}_{n}") for n in ("packed", "scales", "zeros", "g_idx"))
        return torch.stack([dequantize(q[e], s[e], z[e], None if g is None else g[e], self.layout.bits,
                                       self.layout.group, dtype) for e in range(q.shape[0])])

    def apply(self, moe: FusedMoE, x, topk_weights, topk_ids) -> torch.Tensor:
        # every expert dequantized: [E, 2 inter, hidden] and [E, hidden, inter]
        return fused_experts(x, self._weights(moe, "w13", x.dtype), self._weights(moe, "w2", x.dtype),
                             topk_weights, topk_ids)


def _new_param(spec: Spec, leading: tuple[int, ...], device, loader) -> nn.Parameter:
    p = empty_param((*leading, *spec.shape), spec.dtype, device, loader)
    if spec.shared:
        p.data.fill_(-1)
    return p


def _set_packed(module: nn.Module, prefix: str, packed):
    q, s, z, g = packed
    for name, t in (("packed", q), ("scales", s.float()), ("zeros", z.to(torch.int32)),
                    ("g_idx", None if g is None else g.to(torch.int32))):
        setattr(module, f"{prefix}_{name}", None if t is None else nn.Parameter(t.contiguous(),
                                                                               requires_grad=False))
