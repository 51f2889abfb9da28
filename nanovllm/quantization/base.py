"""The quantization interface: one QuantizationConfig per checkpoint format (read once from its
`quantization_config`), which gives each linear layer and each FusedMoE a method object. The method
owns the layer's weights from then on:

  create_weights(layer)               before loading: the format's parameters (packed weights,
                                      scales, zero points ...) replace the layer's `weight`, each with
                                      a weight_loader that takes this rank's shard of a checkpoint tensor
  process_weights_after_loading(layer, loaded)
                                      after loading (loaded False: dummy or unquantized weights, which
                                      the method quantizes itself), turns them into what apply reads
  apply(layer, x, ...)                the layer's GEMM (dense) or grouped GEMMs (experts)

The layers only call `layer.quant.apply` (layers/linear.py, layers/fused_moe.py); the engine and the
models name no method. A format is a module with its QuantizationConfig subclass, and one line in
quantization/__init__.py's registry."""
import re

import torch
from torch import nn

from nanovllm.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear
from nanovllm.utils.loader import CheckpointNames


class LinearMethod:
    """How one linear layer stores and multiplies its weight (see the module's docstring)."""

    def create_weights(self, layer: LinearBase):
        raise NotImplementedError

    def process_weights_after_loading(self, layer: LinearBase, loaded: bool):
        pass

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None,
              into: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ bias); into (no bias): the product added into it in place, and returned."""
        raise NotImplementedError

    def apply_unscaled(self, layer: LinearBase, x: torch.Tensor) -> tuple[torch.Tensor, tuple | None]:
        """(x W^T, None); a method whose GEMM can leave its output scales to the caller returns the
        unscaled product and (row scales, column scales) instead (ColumnParallelLinear.forward_unscaled)."""
        return self.apply(layer, x, None), None


class MoEMethod:
    """How a FusedMoE stores and runs its experts (see the module's docstring)."""

    def create_weights(self, moe: nn.Module):
        raise NotImplementedError

    def process_weights_after_loading(self, moe: nn.Module, loaded: bool):
        pass

    def apply(self, moe: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, hidden]; topk_*: [num_tokens, top_k] -> this rank's partial sum
        [num_tokens, hidden]."""
        raise NotImplementedError


class QuantizationConfig:
    """One checkpoint format, read from its quantization_config (a frozen dataclass in each format's
    module). ignore: the modules it keeps unquantized (names, or 're:' + a pattern)."""
    ignore: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, qc: dict) -> "QuantizationConfig":
        """The format from a checkpoint's quantization_config; ValueError for a variant not run."""
        raise NotImplementedError

    @property
    def names(self) -> CheckpointNames:
        """The checkpoint tensors the loader skips, keeps aside or renames (utils/loader.py)."""
        return CheckpointNames()

    @property
    def reads_checkpoint(self) -> bool:
        """The weights are read in the format (False: the checkpoint is unquantized and the methods
        quantize its weights after loading, e.g. quantization='fp8')."""
        return True

    def linear_method(self, name: str, layer: LinearBase) -> LinearMethod | None:
        """The method of a sharded linear layer the format quantizes; None: left unquantized."""
        raise NotImplementedError

    def moe_method(self, name: str, moe: nn.Module) -> MoEMethod | None:
        raise NotImplementedError

    def ignores(self, module_name: str) -> bool:
        """A module the checkpoint keeps unquantized (HF's modules_to_not_convert or compressed-tensors'
        ignore list: plain names match the module or a prefix of it; 're:' patterns match the name)."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module_name):
                    return True
            elif module_name == entry or module_name.startswith(entry + ".") or module_name.endswith(
                    "." + entry):
                return True
        return False


# ---- the geometry of a linear layer's shards, for the methods' weight loaders ----------------------

def output_part(layer: LinearBase, shard_id) -> tuple[int, int]:
    """(offset, size): the output rows of this rank's W that checkpoint projection shard_id fills (the
    geometry of the layer's own weight_loader); the whole of this rank's rows for shard_id None."""
    if isinstance(layer, QKVParallelLinear):
        q, kv = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
        return {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
    if isinstance(layer, MergedColumnParallelLinear):
        sizes = [size // layer.tp_size for size in layer.output_sizes]
        return sum(sizes[:shard_id]), sizes[shard_id]
    return 0, layer.out_features


def empty_param(shape, dtype: torch.dtype, device: torch.device, loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    p.weight_loader = loader
    return p
