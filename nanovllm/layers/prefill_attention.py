"""Prefill attention, chosen once when the engine starts (Config.prefill_attention), and the start-up
line that says which kernels run:

  "flash_attn_4": FlashAttention-4 (`pip install 'nanovllm[flash]'`), straight over the paged cache;
                  Hopper (sm90) or sm100/sm110 (kernels/fa4_prefill.py);
  "triton":       the project's Triton FlashAttention kernel, straight over the paged cache, FP8 pages
                  included (kernels/triton_prefill.py); fp16/bf16 and head_dim a power of two, else
                  "torch_flash"'s path;
  "torch_flash":  torch's built-in FlashAttention-2 varlen op, after a gather of the pages when there
                  is a cached prefix (kernels.prefill_attention; the torch reference on CPU, for
                  float32 models and with NANOVLLM_KERNELS=torch);
  "auto":         "flash_attn_4" where it can run, else "triton" on Hopper and datacenter Blackwell
                  (measured faster than FlashAttention-2 on Hopper: docs/attention.md), else
                  "torch_flash".
Decode runs the project's Triton paged kernel with any of them. With an FP8 KV cache, FA4 runs the
prefills that have no cached prefix (their new K/V are in the model's dtype); those that read FP8
pages take "torch_flash"'s path, since FA4 reads FP8 only on sm100.
Another prefill kernel is a name in config.PREFILL_ATTENTION and a branch of select_prefill_attention.
"""
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanovllm.config import PREFILL_ATTENTION
from nanovllm.kernels import KERNELS, prefill_attention
from nanovllm.layers.attention_backend import AttentionBackend

FA4_ARCHS = (9, 10, 11)   # compute capability majors where FA4's paged prefill runs
# "auto" takes the Triton kernel on Hopper (where it was measured) and datacenter Blackwell (sm100):
# its 128 x 128 tiles need about 160-224 KB of shared memory, more than consumer GPUs' (sm120) 99 KB
TRITON_AUTO_ARCHS = (9, 10)
# Causal prefill attention of long prompts on one H200, TFLOP/s, in the start-up hint
# (docs/attention.md has the figures): FA4, and the Triton kernel over pages / on new prompts
FA4_TFLOPS, TRITON_TFLOPS = "632", "351-433"
FA4_INSTALL = "pip install 'nanovllm[flash]'"
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class PrefillAttention:
    name: str            # "flash_attn_4" or "torch_flash"
    prefill: Callable    # kernels.prefill_attention's interface
    description: str     # what runs for prefill
    startup_line: str    # which kernels run (describe_kernels): logged by every rank at start-up
    hint: str | None = None   # a faster choice this machine could have: logged by the first rank
    compile_variants: Callable | None = None   # kernels/triton_prefill.compile_variants' interface

    @property
    def backend(self) -> AttentionBackend:
        """The attention back end that runs this prefill kernel (and the paged decode kernel)."""
        return AttentionBackend(self.prefill)

    def start_warm_up(self, attn, page: int, dtype: torch.dtype, kv_dtype: torch.dtype,
                      forward_max_q: int) -> Callable[[], None]:
        """Compile the prefill kernel's variants at start-up (attn: an Attention layer, for its shapes
        and device; forward_max_q: the warm-up forward's new tokens a sequence, whose variant that
        forward compiles); returns the function that waits for compiles still running in threads."""
        device = attn.k_cache.device
        if self.compile_variants is not None and device.type == "cuda":
            return self.compile_variants(attn.num_heads, attn.num_kv_heads, attn.head_dim, page, dtype,
                                         kv_dtype, device, forward_max_q)
        return lambda: None

    def log(self, logger: logging.Logger, first_rank: bool):
        logger.info("%s", self.startup_line)
        if self.hint and first_rank:
            logger.warning("%s", self.hint)


def import_fa4_prefill() -> Callable:
    """FA4's prefill function; raises what importing the package raises (ImportError when it is
    not installed; a broken install may raise other errors)."""
    from nanovllm.kernels.fa4_prefill import prefill_attention_fa4
    return prefill_attention_fa4


def fa4_unavailable_reason(device: torch.device) -> str | None:
    """Why FA4 cannot run on this device (None: it can, if the package imports)."""
    if device.type != "cuda":
        return f"needs a CUDA device, and this engine runs on {device.type}"
    if KERNELS == "torch":
        return "is off with the torch reference kernels (NANOVLLM_KERNELS=torch, or no triton)"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in FA4_ARCHS:
        return f"needs an NVIDIA GPU of compute capability 9.x (Hopper) or newer; this one is {major}.{minor}"
    return None


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton prefill kernel cannot run on this device (None: it can)."""
    if device.type != "cuda":
        return f"needs a CUDA device, and this engine runs on {device.type}"
    if KERNELS == "torch":
        return "is off with the torch reference kernels (NANOVLLM_KERNELS=torch, or no triton)"
    return None


def select_prefill_attention(name: str, device: torch.device, dtype: torch.dtype,
                             kv_cache_dtype: torch.dtype) -> PrefillAttention:
    """The prefill attention `name` asks for on this device, for a model of `dtype` and a KV cache of
    `kv_cache_dtype`, or a ValueError that says why it cannot run."""
    if name not in PREFILL_ATTENTION:
        raise ValueError(f"prefill_attention must be one of {PREFILL_ATTENTION}, got {name!r}")
    if name == "torch_flash":
        return _torch_flash(device, dtype, None)
    if name == "triton":
        if (reason := triton_unavailable_reason(device)) is not None:
            raise ValueError(f"prefill_attention='triton' {reason}; use 'auto' or 'torch_flash'")
        return _triton(device, dtype, None)
    reason, error = fa4_unavailable_reason(device), None
    if reason is None:
        try:
            prefill = import_fa4_prefill()
        except Exception as e:   # a missing package, or a broken install: both fall back under "auto"
            error = e
            reason = ("is not installed" if isinstance(e, ModuleNotFoundError)
                      else f"failed to import ({type(e).__name__}: {e})") + f": {FA4_INSTALL}"
        else:
            return _fa4(device, prefill, dtype, kv_cache_dtype)
    if name == "flash_attn_4":
        raise ValueError(f"prefill_attention='flash_attn_4' {reason}; use 'auto' or 'torch_flash'") \
            from error
    if triton_unavailable_reason(device) is None and \
            torch.cuda.get_device_capability(device)[0] in TRITON_AUTO_ARCHS:
        hint = None
        if error is not None:   # "auto" on a GPU where FA4 runs, without the package
            hint = (f"FlashAttention-4 runs prefill attention faster than the Triton kernel on Hopper "
                    f"({FA4_TFLOPS} against {TRITON_TFLOPS} TFLOP/s on an H200); to use it: {FA4_INSTALL}")
        return _triton(device, dtype, reason, hint)
    return _torch_flash(device, dtype, reason)


def _fa4(device: torch.device, prefill: Callable, dtype: torch.dtype,
         kv_cache_dtype: torch.dtype) -> PrefillAttention:
    if dtype not in _HALF:
        text = f"the torch reference ({str(dtype).removeprefix('torch.')}: FlashAttention-4 runs fp16/bf16)"
    else:
        text = "FlashAttention-4 over the paged cache"
        if kv_cache_dtype.itemsize == 1:
            text += (" (FP8 KV cache: prefills that read cached pages take torch's FlashAttention-2 after a "
                     "dequantizing gather, as FA4 reads FP8 only on sm100)")
    return PrefillAttention("flash_attn_4", prefill, text, describe_kernels(device, text))


def _triton(device: torch.device, dtype: torch.dtype, fa4_reason: str | None,
            hint: str | None = None) -> PrefillAttention:
    from nanovllm.kernels.triton_prefill import compile_variants, prefill_attention_triton_or_torch
    choice = _choice("triton", prefill_attention_triton_or_torch, device, dtype, fa4_reason, hint,
                     "the Triton FlashAttention kernel over the paged cache", "the Triton kernel")
    return dataclasses.replace(choice, compile_variants=compile_variants)


def _torch_flash(device: torch.device, dtype: torch.dtype, fa4_reason: str | None,
                 hint: str | None = None) -> PrefillAttention:
    return _choice("torch_flash", prefill_attention, device, dtype, fa4_reason, hint,
                   "torch FlashAttention-2", "FlashAttention-2")


def _choice(name: str, prefill: Callable, device: torch.device, dtype: torch.dtype, fa4_reason: str | None,
            hint: str | None, kernel: str, short: str) -> PrefillAttention:
    """A fp16/bf16 kernel: what runs (the torch reference off CUDA and for other dtypes), and why FA4
    does not, when it was asked for under "auto"."""
    if device.type != "cuda" or KERNELS == "torch":
        text = "the torch reference"
    elif dtype not in _HALF:
        text = f"the torch reference ({str(dtype).removeprefix('torch.')}: {short} runs fp16/bf16)"
    else:
        text = kernel
    if fa4_reason is not None:
        text += f" (flash_attn_4 {fa4_reason})"
    return PrefillAttention(name, prefill, text, describe_kernels(device, text), hint)


def describe_kernels(device: torch.device, prefill: str) -> str:
    """The start-up line: which kernels run, and for attention which prefill and decode kernels."""
    if device.type != "cuda":
        return "kernels: torch reference (CPU)"
    if KERNELS == "torch":
        return "kernels: torch reference (NANOVLLM_KERNELS=torch, or no triton)"
    return (f"kernels: triton; prefill attention: {prefill}; "
            "decode attention: Triton paged kernel")
