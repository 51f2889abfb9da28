import torch
from torch import nn

# plain torch on CPU (kernels/reference.py), one Triton kernel on CUDA
from nanovllm.kernels import silu_and_mul


class SiluAndMul(nn.Module):
    """x: [..., 2 * d] holding gate and up projections -> silu(gate) * up: [..., d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
