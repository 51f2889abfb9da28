"""Mixture-of-experts MLP (Qwen3-MoE's sparse block): a router picks top_k experts per token, each
expert is a SiLU-gated MLP, and the token's output is their router-weighted sum.

Tensor parallelism shards every expert the way the dense MLP is sharded: each rank holds all experts
with 1/tp of each one's intermediate columns (gate/up rows, down columns), so a rank's sum is a
partial sum and one all-reduce per layer completes it. The router is replicated."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.config import num_experts_of
from nanovllm.kernels import KERNELS
from nanovllm.kernels.moe_reference import fused_moe_ref, select_experts
from nanovllm.layers.linear import ReplicatedLinear, _divide, _shard
from nanovllm.parallel.parallel_state import all_reduce, tp_rank, tp_size
from nanovllm.utils.loader import default_weight_loader

if KERNELS != "torch":
    from nanovllm.kernels.fused_moe import fused_moe_triton
    from nanovllm.kernels.moe_routing import select_experts_triton


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """(weights, ids): [num_tokens, top_k] each; one Triton kernel on CUDA."""
    if router_logits.is_cuda and KERNELS != "torch":
        return select_experts_triton(router_logits, top_k, renormalize)
    return select_experts(router_logits, top_k, renormalize)


def fused_experts(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """The Triton kernels on CUDA, the torch reference elsewhere (see kernels/fused_moe.py)."""
    if x.is_cuda and KERNELS != "torch":
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ValueError("the torch MoE reference reads the routing on the host, which a CUDA graph cannot "
                         "capture: with NANOVLLM_KERNELS=torch pass enforce_eager=True")
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)


class FusedMoE(nn.Module):
    """num_experts SiLU-gated MLPs stacked into two parameters (this rank's shard):
    w13: [num_experts, 2 * inter / tp, hidden] (gate rows, then up rows);
    w2: [num_experts, hidden, inter / tp].
    Checkpoint tensors arrive one expert and projection at a time, shard_id = (expert, 0 gate | 1 up)
    for w13 and (expert, 0) for w2 (utils/loader.py maps HF's per-expert names). quant: None, or the
    MoEMethod of quantized experts (nanovllm/quantization sets it, with the format's parameters in
    place of w13 / w2); hidden: the experts' input size."""

    quant = None

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.inter = _divide(intermediate_size, self.tp_size, "moe_intermediate_size")
        self.num_experts, self.hidden = num_experts, hidden_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter))
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int]):
        expert, index = shard_id
        if not 0 <= expert < param.shape[0]:
            raise ValueError(f"expert {expert} is past the config's num_experts ({param.shape[0]})")
        if param is self.w13:   # gate or up: [inter, hidden], split along the intermediate rows
            dest = param.data[expert].narrow(0, index * self.inter, self.inter)
            loaded = _shard(loaded, 0, self.inter, self.tp_rank, self.tp_size)
        else:                   # down: [hidden, inter], split along the intermediate columns
            dest = param.data[expert]
            loaded = _shard(loaded, 1, self.inter, self.tp_rank, self.tp_size)
        default_weight_loader(dest, loaded)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden]; topk_*: [num_tokens, top_k]
        # -> this rank's partial sum: [num_tokens, hidden]
        if self.quant is not None:
            return self.quant.apply(self, x, topk_weights, topk_ids)
        return fused_experts(x, self.w13, self.w2, topk_weights, topk_ids)


class SparseMoeBlock(nn.Module):
    """Router (`gate`, a linear layer to num_experts logits) and experts, named as in HF checkpoints."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        num_experts = num_experts_of(config)
        self.top_k = config.num_experts_per_tok
        if not 1 <= self.top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be between 1 and num_experts "
                             f"({num_experts})")
        self.renormalize = bool(getattr(config, "norm_topk_prob", False))
        self.gate = ReplicatedLinear(config.hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, config.hidden_size, config.moe_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden] -> [num_tokens, hidden]
        topk_weights, topk_ids = route(self.gate(x), self.top_k, self.renormalize)
        return all_reduce(self.experts(x, topk_weights, topk_ids))
