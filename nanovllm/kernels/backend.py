"""The kernels, chosen once at import, and the entry points the layers call (attention, q/k norm +
rotary + KV store, RMSNorm, SiLU-and-mul; layers/fused_moe.py reads KERNELS for the MoE kernels too).

KERNELS names what runs on CUDA tensors:
  "triton": the project's Triton decode, q/k norm + rotary + KV store, RMSNorm, SiLU-and-mul and MoE
            kernels; prefill attention here is torch's built-in FlashAttention-2 (fp16/bf16; fp32 and
            other misfits take the reference). Config.prefill_attention may put FlashAttention-4 in
            its place (layers/prefill_attention.py);
  "torch":  the plain torch reference everywhere.
CPU tensors always take the torch reference, whatever was chosen.
NANOVLLM_KERNELS=triton|torch forces the choice (NANOVLLM_ATTENTION_BACKEND, its former name, is
still read when NANOVLLM_KERNELS is unset).
"""
import importlib.util
import logging

import torch

import nanovllm.envs as envs
from nanovllm.kernels.reference import (add_rms_norm_ref, paged_decode_attention_ref, prefill_attention_ref,
                                        qk_norm_rope_store_ref, rms_norm_ref, silu_and_mul_ref)

logger = logging.getLogger(__name__)


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def choose_kernels(environ=None) -> str:
    """"triton" or "torch": $NANOVLLM_KERNELS (or the deprecated $NANOVLLM_ATTENTION_BACKEND) when set,
    else "triton" where CUDA and triton are both there. environ: this process's environment by default."""
    var = envs.KERNELS
    forced = var.get(environ)
    if forced is None:
        forced = envs.ATTENTION_BACKEND.get(environ)
        if forced is not None:
            var = envs.ATTENTION_BACKEND
            logger.warning("%s is deprecated: set %s=%s instead", var.name, envs.KERNELS.name, forced)
    if forced is not None:
        if forced != "torch" and not _has_module("triton"):
            raise ValueError(f"{var.name}={forced!r} needs triton; use 'torch'")
        return forced
    if not torch.cuda.is_available() or not _has_module("triton"):
        return "torch"
    return "triton"


KERNELS = choose_kernels()

if KERNELS != "torch":
    from nanovllm.kernels.decode_attention import paged_decode_attention_triton
    from nanovllm.kernels.flash_prefill import aten_flash_usable, prefill_attention_aten
    from nanovllm.kernels.norm_act import add_rms_norm_triton, rms_norm_triton, silu_and_mul_triton
    from nanovllm.kernels.qk_norm_rope import qk_norm_rope_store_triton


def _fast(t: torch.Tensor) -> bool:
    return t.is_cuda and KERNELS != "torch"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden] -> weight * normalised x (transformers' roundings); one kernel on CUDA."""
    return rms_norm_triton(x, weight, eps) if _fast(x) else rms_norm_ref(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """x, residual: [..., hidden] -> (rms_norm(x + residual), x + residual); one kernel on CUDA."""
    fn = add_rms_norm_triton if _fast(x) else add_rms_norm_ref
    return fn(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor, norm_of: torch.Tensor | None = None, eps: float = 0.0,
                 fp8_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x: [..., 2 * d] = gate | up -> silu(gate) * up: [..., d]; one kernel on CUDA. fp8_scales (xs
    [rows, 1], ws [2 * d]): x first scaled by them (the scales of an FP8 GEMM that left them to us).
    norm_of [..., hidden]: gate and up then scaled by rstd(norm_of) row by row (an RMSNorm folded into
    the GEMM that made x)."""
    return (silu_and_mul_triton if _fast(x) else silu_and_mul_ref)(x, norm_of, eps, fp8_scales)


def qk_norm_rope_store(qkv: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                       eps: float, cos_sin_cache: torch.Tensor, positions: torch.Tensor,
                       slot_mapping: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       num_heads: int, num_kv_heads: int, head_dim: int,
                       k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                       norm_of: torch.Tensor | None = None, norm_eps: float = 0.0):
    """qkv scaled by rstd(norm_of) row by row (norm_of given: the input RMSNorm folded into
    qkv_proj), per-head q/k RMSNorm (weights None: none), rotary, and the K/V write into the cache (skipped
    while the cache is empty; an FP8 cache stores K / k_scale, V / v_scale); one fused kernel on
    CUDA. CUDA-graph safe.
    qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
    -> q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]"""
    fn = qk_norm_rope_store_triton if _fast(qkv) else qk_norm_rope_store_ref
    return fn(qkv, q_weight, k_weight, eps, cos_sin_cache, positions, slot_mapping, k_cache, v_cache,
              num_heads, num_kv_heads, head_dim, k_scale, v_scale, norm_of, norm_eps)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None,
                           order: torch.Tensor | None = None, *, window: int = 0,
                           softcap: float = 0.0) -> torch.Tensor:
    # q: [batch, num_heads, head_dim] -> [batch, num_heads, head_dim]; CUDA-graph safe on CUDA
    # k_scale, v_scale: [1] fp32, an FP8 cache's scales; order: [batch] int32, the rows in the order
    # the kernel should start them (a speed hint: the result is the same); window > 0: the last
    # `window` keys only (sliding-window attention); softcap > 0: scores soft-capped (reference.soft_cap)
    masks = dict(window=window, softcap=softcap)
    if not _fast(q):
        return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale,
                                          k_scale, v_scale, **masks)
    return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale,
                                         k_scale=k_scale, v_scale=v_scale, order=order, **masks)


def paged_kv_slots(block_tables: torch.Tensor, cu_seqlens_k: torch.Tensor, total_k: int,
                   block_size: int) -> torch.Tensor:
    """The cache slot of every key token, sequence i's at cu_seqlens_k[i]:cu_seqlens_k[i+1]:
    [total_k] int64. total_k (= cu_seqlens_k[-1]) comes from the host, so this never syncs; the
    runner computes it once per prefill step, not once per layer."""
    cu = cu_seqlens_k.long()
    seq_ids = torch.repeat_interleave(torch.arange(len(cu) - 1, device=cu.device), cu[1:] - cu[:-1],
                                      output_size=total_k)
    pos = torch.arange(total_k, device=cu.device) - cu[seq_ids]
    return block_tables.long()[seq_ids, pos // block_size] * block_size + pos % block_size


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                      max_seqlen_q: int, max_seqlen_k: int,
                      block_tables: torch.Tensor | None, scale: float,
                      kv_slots: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None, *, window: int = 0,
                      softcap: float = 0.0) -> torch.Tensor:
    # q: [total_q, num_heads, head_dim]; k, v: [total_q, num_kv_heads, head_dim], already in the cache.
    # block_tables None: no cached prefix, use k, v; otherwise read keys from the pages, gathered
    # through kv_slots (paged_kv_slots, computed once per step), and dequantized with k_scale, v_scale
    # from an FP8 cache. window, softcap (sliding window, soft-capped scores): the torch reference
    # (torch's FlashAttention-2 op has neither; layers/attention_backend.py takes the Triton kernel
    # for them on CUDA where it fits).
    args = (q, k, v, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            block_tables, scale)
    if not _fast(q) or window or softcap:
        return prefill_attention_ref(*args, k_scale, v_scale, window=window, softcap=softcap)
    if block_tables is not None and kv_slots is None:   # a caller other than the runner: one host sync
        kv_slots = paged_kv_slots(block_tables, cu_seqlens_k, int(cu_seqlens_k[-1]), k_cache.shape[1])
    if aten_flash_usable(q):
        return prefill_attention_aten(*args, kv_slots, k_scale, v_scale)
    return prefill_attention_ref(*args, k_scale, v_scale)
