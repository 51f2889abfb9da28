from nanovllm.kernels.backend import (KERNELS, add_rms_norm, paged_decode_attention, paged_kv_slots,
                                      prefill_attention, qk_norm_rope_store, rms_norm, silu_and_mul)

__all__ = ["KERNELS", "add_rms_norm", "paged_decode_attention", "paged_kv_slots",
           "prefill_attention", "qk_norm_rope_store", "rms_norm", "silu_and_mul"]
