"""FP8 weights on the linear layers and the experts (utils/quant_config.py names the formats).

A quantized layer's `weight` is float8_e4m3fn and `weight_scale` (w13_scale / w2_scale for the
experts) holds its float32 dequantization scales: per block [ceil(N/bn), ceil(K/bk)] or per output
channel [N, 1] (a checkpoint's per-tensor scale is loaded onto every row). `layer.quant` runs the
GEMM: on CUDA the FP8 kernels (kernels/fp8_gemm.py; the experts in kernels/fused_moe.py), elsewhere
the weight dequantized into the activations' dtype and a plain GEMM (what transformers computes on
the dequantized model; activations stay unrounded, clipped to +-activation_scale_ub for fbgemm_fp8).

Tensor parallelism shards the scales with their weights: a block scale row (column) covers bn rows
(bk columns) of W, so a shard or a packed projection (q/k/v, gate/up) must start and end on a
block; anything else is a ValueError naming the sizes. Per-channel scales follow the output rows
(row-parallel layers keep them whole).

Which layers: every sharded linear layer and every FusedMoE (not in fbgemm_fp8), except those the
checkpoint's ignore list names; replicated layers (the MoE router), embeddings and lm_head stay
unquantized."""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels import KERNELS
from nanovllm.kernels.fp8_reference import dequantize_weight, quantize_weight
from nanovllm.kernels.reference import FP8_DTYPE as FP8
from nanovllm.kernels.moe_reference import fused_moe_ref
from nanovllm.layers.fused_moe import FusedMoE
from nanovllm.layers.linear import (LinearBase, MergedColumnParallelLinear, QKVParallelLinear,
                                    ReplicatedLinear, _shard)
from nanovllm.utils.loader import default_weight_loader
from nanovllm.utils.quant_config import Fp8Scheme

if KERNELS != "torch":
    from nanovllm.kernels.fp8_gemm import fp8_linear, fp8_linear_unscaled
    from nanovllm.kernels.fused_moe import fused_moe_triton


def _on_gpu_kernels(x: torch.Tensor) -> bool:
    return x.is_cuda and KERNELS != "torch"


class Fp8Linear:
    """The GEMM of a linear layer whose weight is FP8; scale_ub: fbgemm_fp8's activation_scale_ub (no
    token's activations scaled past it: larger values saturate, on the CPU path clipped to +-scale_ub)."""

    def __init__(self, block: tuple[int, int] | None, scale_ub: float | None = None):
        assert block is None or scale_ub is None, "activation_scale_ub bounds a token, not a group"
        self.block, self.scale_ub = block, scale_ub

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None,
              into: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ bias); into: added into it in place (the residual stream), and returned."""
        if _on_gpu_kernels(x):
            return fp8_linear(x, layer.weight, layer.weight_scale, self.block, bias, into, self.scale_ub)
        if self.scale_ub is not None and self.scale_ub < torch.finfo(x.dtype).max:
            x = x.clamp(-self.scale_ub, self.scale_ub)
        y = F.linear(x, dequantize_weight(layer.weight, layer.weight_scale, self.block, x.dtype), bias)
        return y if into is None else into.add_(y)

    def apply_unscaled(self, layer: LinearBase, x: torch.Tensor):
        """(x W^T unscaled, (row scales, column scales)) where fp8_linear_unscaled leaves the scales to
        the caller (CUDA, per channel, decode sizes); else (x W^T, None)."""
        if _on_gpu_kernels(x):
            return fp8_linear_unscaled(x, layer.weight, layer.weight_scale, self.block, self.scale_ub)
        return self.apply(layer, x, None), None


class Fp8MoE:
    """The experts' grouped GEMMs with FP8 w13 / w2."""

    def __init__(self, block: tuple[int, int] | None):
        self.block = block

    def apply(self, moe: FusedMoE, x, topk_weights, topk_ids) -> torch.Tensor:
        if _on_gpu_kernels(x):
            return fused_moe_triton(x, moe.w13, moe.w2, topk_weights, topk_ids,
                                    scales=(moe.w13_scale, moe.w2_scale, self.block))
        w13 = dequantize_weight(moe.w13, moe.w13_scale, self.block, x.dtype)
        w2 = dequantize_weight(moe.w2, moe.w2_scale, self.block, x.dtype)
        return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)


# ---- which modules, and turning them to FP8 ----------------------------------------------------

def quantized_modules(model: nn.Module, scheme: Fp8Scheme) -> list[tuple[str, nn.Module]]:
    """(name, module) of every layer the scheme quantizes. A packed layer (qkv_proj, gate_up_proj) is
    quantized unless the ignore list names all its checkpoint projections (some of them: ValueError)."""
    mapping = getattr(model, "packed_modules_mapping", {})
    chosen = []
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            if scheme.experts and not scheme.ignores(name):
                chosen.append((name, module))
        elif isinstance(module, LinearBase) and not isinstance(module, ReplicatedLinear):
            prefix, _, leaf = name.rpartition(".")
            parts = [f"{prefix}.{key}" for key, (packed, _) in mapping.items() if packed == leaf] or [name]
            ignored = [scheme.ignores(p) for p in parts]
            if any(ignored) and not all(ignored):
                raise ValueError(f"the checkpoint's ignore list keeps some of {parts} unquantized, not all: "
                                 f"nanovllm packs them into one layer ({name}) and needs one format for it")
            if not any(ignored):
                chosen.append((name, module))
    return chosen


def prepare_fp8(model: nn.Module, scheme: Fp8Scheme | None, load_format: str) -> bool:
    """Before loading an FP8 checkpoint: the chosen layers get empty FP8 weights and scales, with
    loaders that shard them. Returns whether it did (else finish_loading quantizes after loading)."""
    if scheme is None or scheme.online or load_format == "dummy":
        return False
    model.unread_tensors = scheme.unread   # static input scales: skipped (per token instead)
    model.kv_scale_names = scheme.kv_scales   # static KV scales: kept (layers/attention.py: kv_scale_rows)
    for _, module in quantized_modules(model, scheme):
        if isinstance(module, FusedMoE):
            _prepare_moe(module, scheme.block)
        else:
            _prepare_linear(module, scheme.block, scheme.activation_scale_ub)
    return True


def finish_loading(model: nn.Module, scheme: Fp8Scheme | None, prepared: bool):
    """After loading: fold the RMSNorm weights into the GEMMs where the model can (models/llama.py;
    not into FP8 weights), then quantize unquantized weights in the scheme's format (quantization='fp8'
    on a bf16 checkpoint, or dummy weights), so folded weights are quantized once."""
    if hasattr(model, "fold_norms"):
        model.fold_norms()
    if scheme is None or prepared:
        return
    with torch.no_grad():
        for _, module in quantized_modules(model, scheme):
            if isinstance(module, FusedMoE):
                for name in ("w13", "w2"):
                    w, s = quantize_weight(getattr(module, name).data, scheme.block)
                    setattr(module, name, nn.Parameter(w, requires_grad=False))
                    setattr(module, f"{name}_scale", nn.Parameter(s, requires_grad=False))
                _check_moe_blocks(module, scheme.block)
                module.quant = Fp8MoE(scheme.block)
            else:
                w, s = quantize_weight(module.weight.data, scheme.block)
                module.weight = nn.Parameter(w, requires_grad=False)
                module.weight_scale = nn.Parameter(s, requires_grad=False)
                module.quant = Fp8Linear(scheme.block, scheme.activation_scale_ub)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _fp8_param(shape, like: torch.Tensor, loader, dtype=FP8) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=like.device), requires_grad=False)
    p.weight_loader = loader
    return p


def _fp8_only(loader):
    """A weight loader that refuses an unquantized tensor (copy_ would cast it without a scale)."""
    def load(param, loaded, *shard_id):
        if loaded.dtype != FP8:
            raise ValueError(f"dtype {loaded.dtype}, but the checkpoint's quantization_config makes this "
                             "layer FP8 (float8_e4m3fn)")
        loader(param, loaded, *shard_id)
    return load


def _prepare_linear(layer: LinearBase, block, scale_ub: float | None = None):
    n, k = layer.weight.shape
    layer.weight = _fp8_param((n, k), layer.weight, _fp8_only(layer.weight_loader))
    shape = (n, 1) if block is None else (_cdiv(n, block[0]), _cdiv(k, block[1]))

    def load(param, loaded, *shard_id):
        _load_linear_scale(layer, block, param, loaded, *shard_id)
    layer.weight_scale = _fp8_param(shape, layer.weight, load, dtype=torch.float32)
    layer.quant = Fp8Linear(block, scale_ub)


def _output_part(layer: LinearBase, shard_id) -> tuple[int, int]:
    """(offset, size): the rows of this rank's W that checkpoint projection shard_id fills (the
    geometry of the layer's own weight_loader)."""
    if isinstance(layer, QKVParallelLinear):
        q, kv = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
        return {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
    if isinstance(layer, MergedColumnParallelLinear):
        sizes = [size // layer.tp_size for size in layer.output_sizes]
        return sum(sizes[:shard_id]), sizes[shard_id]
    return 0, layer.weight.shape[0]


def _block_error(what: str, size: int, block: int) -> ValueError:
    return ValueError(f"{what} ({size}) is not a multiple of the FP8 weight block ({block}): a block's scale "
                      "cannot be split between tensor-parallel ranks or packed projections; choose a "
                      "tensor_parallel_size that keeps each shard a whole number of blocks")


def _load_linear_scale(layer: LinearBase, block, param: torch.Tensor, loaded: torch.Tensor, shard_id=None):
    rows_per, cols_per = block or (1, None)
    split_rows = layer.tp_dim == 0 and layer.tp_size > 1
    dest = param.data
    if shard_id is not None or split_rows:
        offset, size = _output_part(layer, shard_id)
        for what, value in (("a shard's or projection's rows", size), ("a projection's first row", offset)):
            if value % rows_per:
                raise _block_error(what, value, rows_per)
        dest = dest.narrow(0, offset // rows_per, size // rows_per)
    if block is None and loaded.numel() == 1:   # a per-tensor scale: the same on every row
        loaded = loaded.reshape(1, 1).expand_as(dest)
    elif split_rows:
        loaded = _shard(loaded, 0, dest.shape[0], layer.tp_rank, layer.tp_size)
    elif layer.tp_dim == 1 and layer.tp_size > 1 and block is not None:
        k_local = layer.weight.shape[1]
        if k_local % cols_per:
            raise _block_error("a row-parallel shard's input columns", k_local, cols_per)
        loaded = _shard(loaded, 1, k_local // cols_per, layer.tp_rank, layer.tp_size)
    default_weight_loader(dest, loaded)


def _check_moe_blocks(moe: FusedMoE, block):
    if block is not None:
        for b in block:
            if moe.inter % b:
                raise _block_error("moe_intermediate_size / tensor_parallel_size", moe.inter, b)


def _prepare_moe(moe: FusedMoE, block):
    _check_moe_blocks(moe, block)
    e, two_inter, hidden = moe.w13.shape
    moe.w13 = _fp8_param(moe.w13.shape, moe.w13, _fp8_only(moe.weight_loader))
    moe.w2 = _fp8_param(moe.w2.shape, moe.w2, _fp8_only(moe.weight_loader))
    if block is None:
        s13, s2 = (e, two_inter, 1), (e, hidden, 1)
    else:
        s13 = (e, two_inter // block[0], _cdiv(hidden, block[1]))
        s2 = (e, _cdiv(hidden, block[0]), moe.inter // block[1])

    def load(param, loaded, shard_id):
        _load_expert_scale(moe, block, param, loaded, shard_id)
    moe.w13_scale = _fp8_param(s13, moe.w13, load, dtype=torch.float32)
    moe.w2_scale = _fp8_param(s2, moe.w13, load, dtype=torch.float32)
    moe.quant = Fp8MoE(block)


def _load_expert_scale(moe: FusedMoE, block, param, loaded: torch.Tensor, shard_id: tuple[int, int]):
    expert, index = shard_id
    if not 0 <= expert < param.shape[0]:
        raise ValueError(f"expert {expert} is past the config's num_experts ({param.shape[0]})")
    rows_per, cols_per = block or (1, None)
    if param is moe.w13_scale:   # gate or up, split along the intermediate rows
        rows = moe.inter // rows_per
        dest = param.data[expert].narrow(0, index * rows, rows)
    else:                        # down, split along the intermediate columns (per channel: whole)
        dest = param.data[expert]
    if block is None and loaded.numel() == 1:   # a per-tensor scale: the same on every row
        loaded = loaded.reshape(1, 1).expand_as(dest)
    elif param is moe.w13_scale:
        loaded = _shard(loaded, 0, rows, moe.tp_rank, moe.tp_size)
    elif block is not None:
        loaded = _shard(loaded, 1, moe.inter // cols_per, moe.tp_rank, moe.tp_size)
    default_weight_loader(dest, loaded)
