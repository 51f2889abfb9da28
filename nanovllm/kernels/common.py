"""Helpers shared by the Triton kernels: the device's SM count (for sizing grids), the fp32 ->
dtype rounding that reproduces eager torch's intermediate casts, and programmatic dependent launch.

Programmatic dependent launch (PDL, sm_90 and later): a kernel launched with launch_pdl=True may be
scheduled before the kernel ahead of it in the stream has finished, so its launch and set-up overlap
that kernel's tail (inside a CUDA graph as well as eagerly). Such a kernel must call
pdl_wait_and_release() before it reads anything an earlier kernel wrote or writes anything one may
still read: griddepcontrol.wait returns once the kernel ahead has completed and its writes are
visible, and as that kernel waited likewise, every earlier kernel has too. The same call lets the
kernel after it be scheduled early. Kernels without it (cuBLAS, torch's) keep ordinary stream order.
NANOVLLM_PDL=0 turns it off (every launch then orders as usual).
"""
import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 elsewhere (the Triton interpreter's stand-in)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _pdl_supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(device: torch.device) -> bool:
    """Launch the project's kernels on `device` with programmatic dependent launch: CUDA on sm_90+
    unless NANOVLLM_PDL=0 (read at each launch, so a test can compare both in one process)."""
    if device.type != "cuda" or os.environ.get("NANOVLLM_PDL", "1") == "0":
        return False
    return _pdl_supported(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def pdl_wait_and_release(PDL: tl.constexpr):
    """With PDL (a launch_pdl=True launch): wait until the kernel ahead has completed, then let the
    next kernel be scheduled. Without: nothing. Called before the kernel touches shared data."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def rounded(x, DTYPE: tl.constexpr):
    """fp32 x rounded to DTYPE (to nearest, ties to even) and kept in fp32. bf16 by bit arithmetic:
    the Triton interpreter's fp32 -> bf16 cast truncates; on the GPU this equals cvt.rn.bf16.
    NaN stays NaN: the GPU's NaN (0x7FFFFFFF) would carry into the sign bit and become -0.0, hiding
    broken weights."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x == x, bits.to(tl.float32, bitcast=True), x)
    else:
        return x.to(DTYPE).to(tl.float32)
