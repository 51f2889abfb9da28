"""The attention back end of an engine, chosen once at start-up (Config.attention_backend):

  "flash_attn_4": prefill through FlashAttention-4 (`pip install 'nanovllm[flash]'`), straight over
                  the paged cache; Hopper (sm90) or sm100/sm110;
  "triton":       today's path: torch's built-in FlashAttention-2 varlen op for prefill, after a
                  gather of the pages when there is a cached prefix (the torch reference on CPU);
  "auto":         "flash_attn_4" where it can run, else "triton".
Decode runs the project's Triton paged kernel with either.
With an FP8 KV cache, FA4 runs the prefills that have no cached prefix (their new K/V are in the
model's dtype); those that read FP8 pages take today's path, since FA4 reads FP8 only on sm100.
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanovllm.config import ATTENTION_BACKENDS
from nanovllm.kernels import ATTENTION_BACKEND as KERNEL_BACKEND
from nanovllm.kernels import prefill_attention

FA4_ARCHS = (9, 10, 11)   # compute capability majors where FA4's paged prefill runs
FA4_INSTALL = "pip install 'nanovllm[flash]' (the flash-attn-4 package)"


@dataclass(frozen=True)
class AttentionBackend:
    name: str            # one of ATTENTION_BACKENDS but "auto"
    prefill: Callable    # kernels.prefill_attention's interface
    description: str     # for the start-up log


def import_fa4_prefill() -> Callable:
    """FA4's prefill function; raises what importing the package raises (ImportError when it is
    not installed; a broken install may raise other errors)."""
    from nanovllm.kernels.fa4_prefill import prefill_attention_fa4
    return prefill_attention_fa4


def fa4_unavailable_reason(device: torch.device) -> str | None:
    """Why FA4 cannot run on this device (None: it can, if the package imports)."""
    if device.type != "cuda":
        return f"needs a CUDA device (this engine runs on {device.type})"
    if KERNEL_BACKEND == "torch":
        return "is off: the kernels run the torch reference (NANOVLLM_ATTENTION_BACKEND=torch, or no triton)"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in FA4_ARCHS:
        return f"needs an NVIDIA GPU of compute capability 9.x (Hopper) or newer; this one is {major}.{minor}"
    return None


def select_attention_backend(name: str, device: torch.device,
                             kv_cache_dtype: torch.dtype) -> AttentionBackend:
    """The back end `name` asks for on this device, or a ValueError that says why it cannot run."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "triton":
        return _today_backend(device, None)
    reason, error = fa4_unavailable_reason(device), None
    if reason is None:
        try:
            prefill = import_fa4_prefill()
        except Exception as e:   # a missing package, or a broken install: both fall back under "auto"
            reason, error = f"needs {FA4_INSTALL}; importing it failed: {type(e).__name__}: {e}", e
        else:
            return _fa4_backend(prefill, kv_cache_dtype)
    if name == "flash_attn_4":
        raise ValueError(f"attention_backend='flash_attn_4' {reason}; use 'auto' or 'triton'") from error
    return _today_backend(device, reason)


def _fa4_backend(prefill: Callable, kv_cache_dtype: torch.dtype) -> AttentionBackend:
    text = "flash_attn_4 (prefill: FlashAttention-4 over the paged cache; decode: Triton)"
    if kv_cache_dtype.itemsize == 1:
        text += ("; FP8 KV cache: prefills that read cached pages take torch's FlashAttention-2 after a "
                 "dequantizing gather (FA4 reads FP8 only on sm100)")
    return AttentionBackend("flash_attn_4", prefill, text)


def _today_backend(device: torch.device, fa4_reason: str | None) -> AttentionBackend:
    if device.type != "cuda" or KERNEL_BACKEND == "torch":
        text = "triton (the torch reference" + (" on CPU)" if device.type != "cuda" else ")")
    else:
        text = "triton (prefill: torch's FlashAttention-2 varlen op, gathering cached pages; decode: Triton)"
    if fa4_reason is not None:
        text += f"; flash_attn_4 not used: it {fa4_reason}"
    return AttentionBackend("triton", prefill_attention, text)
