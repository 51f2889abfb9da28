"""FP8 weights on the linear layers and the experts (quantization/fp8.py reads the formats).

A quantized layer's `weight` is float8_e4m3fn and `weight_scale` (w13_scale / w2_scale for the
experts) holds its float32 dequantization scales: per block [ceil(N/bn), ceil(K/bk)] or per output
channel [N, 1] (a checkpoint's per-tensor scale is loaded onto every row). apply runs the GEMM: on
CUDA the FP8 kernels (kernels/fp8_gemm.py; the experts in kernels/fused_moe.py), elsewhere the
weight dequantized into the activations' dtype and a plain GEMM (what transformers computes on the
dequantized model; activations stay unrounded, clipped to +-activation_scale_ub for fbgemm_fp8).

Tensor parallelism shards the scales with their weights: a block scale row (column) covers bn rows
(bk columns) of W, so a shard or a packed projection (q/k/v, gate/up) must start and end on a
block; anything else is a ValueError naming the sizes. Per-channel scales follow the output rows
(row-parallel layers keep them whole). A layer whose loader moves rows across blocks (the gated
q_proj, the linear-attention projections) keeps its block scales per row instead: blocks (1, bk)."""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels import KERNELS
from nanovllm.kernels.fp8_reference import dequantize_weight, quantize_weight
from nanovllm.kernels.moe_reference import fused_moe_ref
from nanovllm.kernels.reference import FP8_DTYPE as FP8
from nanovllm.layers.fused_moe import FusedMoE
from nanovllm.layers.linear import LinearBase, _shard
from nanovllm.quantization.base import LinearMethod, MoEMethod, empty_param, output_part
from nanovllm.utils.loader import default_weight_loader

if KERNELS != "torch":
    from nanovllm.kernels.fp8_gemm import fp8_linear, fp8_linear_unscaled
    from nanovllm.kernels.fused_moe import fused_moe_triton


def _on_gpu_kernels(x: torch.Tensor) -> bool:
    return x.is_cuda and KERNELS != "torch"


class Fp8LinearMethod(LinearMethod):
    """A linear layer whose weight is FP8; block: (bn, bk) rows and columns of W per scale, None: one
    scale per output channel; scale_ub: fbgemm_fp8's activation_scale_ub (no token's activations
    scaled past it: larger values saturate, on the CPU path clipped to +-scale_ub)."""

    def __init__(self, block: tuple[int, int] | None, scale_ub: float | None = None):
        assert block is None or scale_ub is None, "activation_scale_ub bounds a token, not a group"
        self.block, self.scale_ub = block, scale_ub

    def create_weights(self, layer: LinearBase):
        n, k, block = layer.out_features, layer.in_features, self.block
        layer.weight = empty_param((n, k), FP8, layer.weight.device, _fp8_only(layer.weight_loader))
        if hasattr(layer, "checkpoint_rows"):   # its loader moves rows across blocks: scales per row
            self.block = None if block is None else (1, block[1])
            shape = (n, 1) if block is None else (n, _cdiv(k, block[1]))

            def load(param, loaded, *shard_id):
                _load_row_scales(layer, block, param, loaded, *shard_id)
        else:
            shape = (n, 1) if block is None else (_cdiv(n, block[0]), _cdiv(k, block[1]))

            def load(param, loaded, *shard_id):
                _load_linear_scale(layer, block, param, loaded, *shard_id)
        layer.weight_scale = empty_param(shape, torch.float32, layer.weight.device, load)

    def process_weights_after_loading(self, layer: LinearBase, loaded: bool):
        if not loaded:   # quantization='fp8' on an unquantized checkpoint, or dummy weights
            with torch.no_grad():
                w, s = quantize_weight(layer.weight.data, self.block)
            layer.weight = nn.Parameter(w, requires_grad=False)
            layer.weight_scale = nn.Parameter(s, requires_grad=False)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None,
              into: torch.Tensor | None = None) -> torch.Tensor:
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


class Fp8MoEMethod(MoEMethod):
    """The experts' grouped GEMMs with FP8 w13 / w2."""

    def __init__(self, block: tuple[int, int] | None):
        self.block = block

    def create_weights(self, moe: FusedMoE):
        _check_moe_blocks(moe, self.block)
        block, e, two_inter, hidden = self.block, *moe.w13.shape
        moe.w13 = empty_param(moe.w13.shape, FP8, moe.w13.device, _fp8_only(moe.weight_loader))
        moe.w2 = empty_param(moe.w2.shape, FP8, moe.w13.device, _fp8_only(moe.weight_loader))
        if block is None:
            s13, s2 = (e, two_inter, 1), (e, hidden, 1)
        else:
            s13 = (e, two_inter // block[0], _cdiv(hidden, block[1]))
            s2 = (e, _cdiv(hidden, block[0]), moe.inter // block[1])

        def load(param, loaded, shard_id):
            _load_expert_scale(moe, block, param, loaded, shard_id)
        moe.w13_scale = empty_param(s13, torch.float32, moe.w13.device, load)
        moe.w2_scale = empty_param(s2, torch.float32, moe.w13.device, load)

    def process_weights_after_loading(self, moe: FusedMoE, loaded: bool):
        if loaded:
            return
        with torch.no_grad():
            for name in ("w13", "w2"):
                w, s = quantize_weight(getattr(moe, name).data, self.block)
                setattr(moe, name, nn.Parameter(w, requires_grad=False))
                setattr(moe, f"{name}_scale", nn.Parameter(s, requires_grad=False))
        _check_moe_blocks(moe, self.block)

    def apply(self, moe: FusedMoE, x, topk_weights, topk_ids) -> torch.Tensor:
        if _on_gpu_kernels(x):
            return fused_moe_triton(x, moe.w13, moe.w2, topk_weights, topk_ids,
                                    scales=(moe.w13_scale, moe.w2_scale, self.block))
        w13 = dequantize_weight(moe.w13, moe.w13_scale, self.block, x.dtype)
        w2 = dequantize_weight(moe.w2, moe.w2_scale, self.block, x.dtype)
        return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)


# ---- loading the scales beside the weights -----------------------------------------------------

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _fp8_only(loader):
    """A weight loader that refuses an unquantized tensor (copy_ would cast it without a scale)."""
    def load(param, loaded, *shard_id):
        if loaded.dtype != FP8:
            raise ValueError(f"dtype {loaded.dtype}, but the checkpoint's quantization_config makes this "
                             "layer FP8 (float8_e4m3fn)")
        loader(param, loaded, *shard_id)
    return load


def _block_error(what: str, size: int, block: int) -> ValueError:
    return ValueError(f"{what} ({size}) is not a multiple of the FP8 weight block ({block}): a block's scale "
                      "cannot be split between tensor-parallel ranks or packed projections; choose a "
                      "tensor_parallel_size that keeps each shard a whole number of blocks")


def _load_linear_scale(layer: LinearBase, block, param: torch.Tensor, loaded: torch.Tensor, shard_id=None):
    rows_per, cols_per = block or (1, None)
    split_rows = layer.tp_dim == 0 and layer.tp_size > 1
    dest = param.data
    if shard_id is not None or split_rows:
        offset, size = output_part(layer, shard_id)
        for what, value in (("a shard's or projection's rows", size), ("a projection's first row", offset)):
            if value % rows_per:
                raise _block_error(what, value, rows_per)
        dest = dest.narrow(0, offset // rows_per, size // rows_per)
    if block is None and loaded.numel() == 1:   # a per-tensor scale: the same on every row
        loaded = loaded.reshape(1, 1).expand_as(dest)
    elif split_rows:
        loaded = _shard(loaded, 0, dest.shape[0], layer.tp_rank, layer.tp_size)
    elif layer.tp_dim == 1 and layer.tp_size > 1 and block is not None:
        k_local = layer.in_features
        if k_local % cols_per:
            raise _block_error("a row-parallel shard's input columns", k_local, cols_per)
        loaded = _shard(loaded, 1, k_local // cols_per, layer.tp_rank, layer.tp_size)
    default_weight_loader(dest, loaded)


def _load_row_scales(layer: LinearBase, block, param: torch.Tensor, loaded: torch.Tensor, *shard_id):
    """A layer whose own weight_loader reorders rows (the gated q_proj's rotary order, the linear
    attention's parts and key-head groups; it has checkpoint_rows): each row keeps its block's scales
    ([rows, ceil(K / bk)], or [rows, 1] per channel), and the layer's loader moves them with the row, so
    no block has to stay whole (run as blocks of (1, bk))."""
    rows = layer.checkpoint_rows(*shard_id)
    if loaded.numel() == 1:   # a per-tensor scale: the same on every row
        loaded = loaded.reshape(1, 1).expand(rows, 1)
    elif block is not None:   # [ceil(rows / bn), ceil(K / bk)] -> [rows, ceil(K / bk)]
        if loaded.size(0) != _cdiv(rows, block[0]):
            raise ValueError(f"shape mismatch: a block scale {tuple(loaded.shape)} for {rows} rows "
                             f"of {block[0]}-row blocks")
        loaded = loaded.repeat_interleave(block[0], dim=0)[:rows]
    layer.weight_loader(param, loaded.reshape(rows, -1), *shard_id)


def _check_moe_blocks(moe: FusedMoE, block):
    if block is not None:
        for b in block:
            if moe.inter % b:
                raise _block_error("moe_intermediate_size / tensor_parallel_size", moe.inter, b)


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
