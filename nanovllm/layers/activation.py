import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.compile import cuda_compiled


@cuda_compiled
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """x: [..., 2 * d] holding gate and up projections -> silu(gate) * up: [..., d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
