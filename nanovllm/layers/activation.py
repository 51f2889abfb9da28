import torch
from torch import nn

# plain torch on CPU (kernels/reference.py), one Triton kernel on CUDA
from nanovllm.kernels import silu_and_mul


class SiluAndMul(nn.Module):
    """x: [..., 2 * d] holding gate and up projections -> silu(gate) * up: [..., d]; fp8_scales: x
    first times these row and column scales (an FP8 GEMM's, ColumnParallelLinear.forward_unscaled); norm_of
    [..., hidden]: gate and up then scaled by its rows' rstd (a folded RMSNorm, eps)."""

    def forward(self, x: torch.Tensor, norm_of: torch.Tensor | None = None, eps: float = 0.0,
                fp8_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        return silu_and_mul(x, norm_of, eps, fp8_scales)
