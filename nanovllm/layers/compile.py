"""torch.compile for the small elementwise ops on CUDA. A decode step otherwise runs thousands of
tiny kernels (RMSNorm alone is ~8 per call), each a few microseconds even inside a CUDA graph;
compiled, each op is one fused kernel. On CPU the plain torch code runs (no compiler needed).
NANOVLLM_COMPILE=0 turns it off.

emulate_precision_casts keeps the roundings the code spells out (x.to(bf16) before a multiply):
by default inductor computes the chain in fp32 and rounds once, which differs from eager torch,
and so from transformers, by one ulp on about a quarter of the bf16 outputs of RMSNorm and SiLU-mul."""
import functools
import os

import torch

ENABLED = os.environ.get("NANOVLLM_COMPILE", "1") != "0"


COMPILE_OPTIONS = dict(dynamic=True, fullgraph=True, options={"emulate_precision_casts": True})


def cuda_compiled(fn):
    compiled = torch.compile(fn, **COMPILE_OPTIONS)

    @functools.wraps(fn)
    def dispatch(x: torch.Tensor, *args):
        return compiled(x, *args) if ENABLED and x.is_cuda else fn(x, *args)
    return dispatch
