import torch
from torch import nn

from nanovllm.layers.compile import cuda_compiled


@cuda_compiled
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers computes it: normalise in fp32, cast back, then scale.
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


@cuda_compiled
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    x = x + residual
    return rms_norm.__wrapped__(x, weight, eps), x


class RMSNorm(nn.Module):
    """RMSNorm; with a residual, the add comes first and is fused with it: returns (norm(x + r), x + r)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
