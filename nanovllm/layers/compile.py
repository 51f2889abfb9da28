"""torch.compile for the small elementwise ops on CUDA. A decode step otherwise runs thousands of
tiny kernels (RMSNorm alone is ~8 per call), each a few microseconds even inside a CUDA graph;
compiled, each op is one fused kernel. On CPU the plain torch code runs (no compiler needed).
NANOVLLM_COMPILE=0 turns it off."""
import functools
import os

import torch

ENABLED = os.environ.get("NANOVLLM_COMPILE", "1") != "0"


def cuda_compiled(fn):
    compiled = torch.compile(fn, dynamic=True, fullgraph=True)

    @functools.wraps(fn)
    def dispatch(x: torch.Tensor, *args):
        return compiled(x, *args) if ENABLED and x.is_cuda else fn(x, *args)
    return dispatch
