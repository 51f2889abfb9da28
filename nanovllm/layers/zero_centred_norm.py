"""The RMSNorm of Qwen3.5 / Qwen3-Next (and Gemma): it scales by 1 + w, where w is the checkpoint's
weight (zeros at initialisation)."""
import torch
from torch import nn


def zero_centred_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' arithmetic: normalised in fp32, times 1 + w in fp32, rounded once. In bf16 this
    matters: storing 1 + w in bf16 (as a plain RMSNorm weight) moved a tiny model's logits 3 times
    further from fp32 than transformers' own bf16 error."""
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


class ZeroCentredRMSNorm(nn.Module):
    """With a residual, the add comes first (in the model's dtype): returns (norm(x + r), x + r)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        # x, residual: [num_tokens, hidden]
        if residual is None:
            return zero_centred_rms_norm(x, self.weight, self.eps)
        x = x + residual
        return zero_centred_rms_norm(x, self.weight, self.eps), x
