"""Mixture-of-experts in plain torch: the router's top-k choice and the experts' weighted sum. The
CPU path, and the oracle of the Triton kernels in kernels/fused_moe.py. The arithmetic is
transformers' Qwen3-MoE (softmax in fp32, top-k, optional renormalisation, weights cast to the
model's dtype; each expert's output times its weight, summed per token in expert order)."""
import torch
import torch.nn.functional as F


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """router_logits: [num_tokens, num_experts] -> (weights: [num_tokens, top_k] in the logits'
    dtype, ids: [num_tokens, top_k] int64), the highest-probability experts first. No host sync:
    safe inside a CUDA graph."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, hidden]; w13: [num_experts, 2 * inter, hidden] (gate rows, then up rows);
    w2: [num_experts, hidden, inter]; topk_weights, topk_ids: [num_tokens, top_k]
    -> sum over k of topk_weights[:, k] * expert_k(x): [num_tokens, hidden], where
    expert(x) = (silu(x @ gate^T) * (x @ up^T)) @ w2[e]^T. Reads the ids on the host (one sync)."""
    out = torch.zeros_like(x)
    for expert in torch.unique(topk_ids).tolist():
        token, slot = torch.where(topk_ids == expert)
        gate, up = F.linear(x[token], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert]) * topk_weights[token, slot, None].to(x.dtype)
        out.index_add_(0, token, y)
    return out
