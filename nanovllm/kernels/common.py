"""Helpers shared by the Triton kernels: the device's SM count (for sizing grids), whether a
launch runs in the Triton interpreter, calls run in threads (compiles at start-up), and the fp32 ->
dtype rounding that reproduces eager torch's intermediate casts."""
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import triton
import triton.language as tl

import nanovllm.envs as envs


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 elsewhere (the Triton interpreter's stand-in)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count


def interpreted(device: torch.device) -> bool:
    """Kernels on this device run in the Triton interpreter: CPU tensors (or TRITON_INTERPRET=1 on any)."""
    return device.type == "cpu" or envs.TRITON_INTERPRET.get()


def in_threads(calls: list[Callable[[], None]], device: torch.device) -> Callable[[], None]:
    """Start each call in a thread of its own (on `device`: a new thread's current CUDA device is
    0) and return the function that waits for them all and raises the first error one raised."""
    def on_device(call):
        if device.type == "cuda":
            torch.cuda.set_device(device)
        call()
    if device.type == "cuda":
        triton.runtime.driver.active.get_current_device()   # Triton's driver set up here, not in a race
    pool = ThreadPoolExecutor(max(1, len(calls)), thread_name_prefix="nanovllm-compile")
    futures = [pool.submit(on_device, call) for call in calls]
    pool.shutdown(wait=False)

    def wait():
        for future in futures:
            future.result()
    return wait


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


@triton.jit
def row_rstd(row_ptr, eps, HIDDEN: tl.constexpr, BLOCK: tl.constexpr):
    """rsqrt(mean(x^2) + eps) of the HIDDEN contiguous values at row_ptr, in fp32 (the sum of
    squares in fp32, the mean by an exact division, as the RMSNorm kernels do)."""
    cols = tl.arange(0, BLOCK)
    x = tl.load(row_ptr + cols, mask=cols < HIDDEN, other=0.0).to(tl.float32)
    sum_sq = tl.sum(x * x, axis=0)
    return tl.math.rsqrt(tl.math.div_rn(sum_sq, tl.full(sum_sq.shape, HIDDEN, tl.float32)) + eps)
