from nanovllm.kernels.backend import (ATTENTION_BACKEND, paged_decode_attention, prefill_attention,
                                      qk_norm_rope_store, store_kvcache)

__all__ = ["ATTENTION_BACKEND", "paged_decode_attention", "prefill_attention", "qk_norm_rope_store",
           "store_kvcache"]
