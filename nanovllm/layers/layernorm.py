import torch
from torch import nn

# transformers' roundings: plain torch on CPU (kernels/reference.py), one Triton kernel on CUDA
from nanovllm.kernels import add_rms_norm, rms_norm


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
