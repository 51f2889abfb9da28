"""Linear layers sharded for tensor parallelism. Each parameter carries a weight_loader that copies
this rank's shard of a checkpoint tensor, so the sharding rule lives next to the layer it shards."""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels.gemv import gemv, gemv_config
from nanovllm.parallel.parallel_state import all_reduce, tp_rank, tp_size
from nanovllm.utils.loader import default_weight_loader


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({d})")
    return n // d


def _shard(loaded: torch.Tensor, dim: int, size: int, rank: int, world: int) -> torch.Tensor:
    """This rank's slice of a checkpoint tensor. The whole tensor must span size * world along
    dim: narrow() alone would silently take the first rows of a tensor that is too large."""
    if loaded.dim() <= dim or loaded.size(dim) != size * world:
        raise ValueError(f"shape mismatch: checkpoint tensor {tuple(loaded.shape)} should have "
                         f"{size * world} entries along dim {dim}")
    return loaded.narrow(dim, rank * size, size)


class LinearBase(nn.Module):
    """y = x W^T (+ b) with W: [output_size, input_size] on this rank. tp_dim: the sharded axis of
    W (0 = output columns, 1 = input rows, None = replicated). quant: None, or the LinearMethod of a
    quantized weight (nanovllm/quantization sets it, and replaces `weight` with the format's
    parameters); out_features, in_features: W's shape on this rank either way. lora: None, or a
    lora.layers.LoRALinear, run before any all-reduce: lora.folded_linear(x) is the layer's output
    with the step's adapters when lora.folds(), else lora(x, y) adds them to its output y."""

    quant = None
    lora = None

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None):
        super().__init__()
        self.tp_dim, self.tp_rank, self.tp_size = tp_dim, tp_rank(), tp_size()
        self.out_features, self.in_features = output_size, input_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None):
        if self.tp_dim is not None and param.dim() > self.tp_dim:   # a row-parallel bias is whole
            loaded = _shard(loaded, self.tp_dim, param.size(self.tp_dim), self.tp_rank, self.tp_size)
        default_weight_loader(param, loaded)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               into: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ bias); into (no bias): the product added into it in place (the GEMM's C, beta 1),
        and returned."""
        assert into is None or bias is None
        if self.quant is not None:
            return self.quant.apply(self, x, bias, into)
        if bias is None and (config := gemv_config(x, self.weight)) is not None:   # decode at batch 1-4
            return gemv(x, self.weight, into, config)
        return F.linear(x, self.weight, bias) if into is None else into.addmm_(x, self.weight.t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is not None and self.lora.folds():
            return self.lora.folded_linear(x)
        y = self.matmul(x, self.bias)
        return y if self.lora is None else self.lora(x, y)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, tp_dim=None)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank returns its slice."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, _divide(output_size, tp_size(), "output size"), bias, tp_dim=0)

    def forward_unscaled(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple | None]:
        """(forward(x), None), or for an FP8 layer (no bias, no LoRA) whose GEMM leaves its scales to
        the caller, (the unscaled product, its row and column scales): the caller multiplies them in.
        (Column-parallel only: each rank's output is final here, with no all-reduce to come.)"""
        if self.quant is None or self.bias is not None or self.lora is not None:
            return self(x), None
        return self.quant.apply_unscaled(self, x)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matrix (gate and up): checkpoint tensor k goes to
    slice k of each rank's output."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int):
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        shard = _shard(loaded, 0, size, self.tp_rank, self.tp_size)
        default_weight_loader(param.data.narrow(0, offset, size), shard)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix; each rank holds its query heads and KV heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False):
        tp = tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp, "number of attention heads")
        self.num_kv_heads = _divide(num_kv_heads, tp, "number of KV heads")
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str):
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        size, offset = {"q": (q, 0), "k": (kv, q), "v": (kv, q + kv)}[shard_id]
        shard = _shard(loaded, 0, size, self.tp_rank, self.tp_size)
        default_weight_loader(param.data.narrow(0, offset, size), shard)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial products are summed with an all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(_divide(input_size, tp_size(), "input size"), output_size, bias, tp_dim=1)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        # The bias is added once, after the sum, not on every rank. residual (the same on every
        # rank): added to the output; without a bias it is rank 0's GEMM's C (beta 1), updated in
        # place, so the sum over ranks holds it once: no add kernel (an FP8 GEMM: added by its
        # scale_out kernel, or after it; a folded LoRA layer: added by its expand kernel, in place).
        into = residual if residual is not None and self.bias is None else None
        own = into if self.tp_rank == 0 else None
        if self.lora is not None and self.lora.folds():
            y = self.lora.folded_linear(x, own)
        else:
            y = self.matmul(x, into=own)
            y = y if self.lora is None else self.lora(x, y)
        y = all_reduce(y)
        if into is not None:
            return y
        y = y + self.bias if self.bias is not None else y
        return y if residual is None else y + residual
