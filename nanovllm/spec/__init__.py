"""Speculative decoding: n-gram drafts from a sequence's own tokens (ngram.py), checked against the
target model in one step of k + 1 query rows per sequence (verify.py), under vLLM's
speculative_config (config.py). docs/speculative.md tells the whole story."""
from nanovllm.spec.config import SpeculativeConfig
from nanovllm.spec.ngram import NgramProposer

__all__ = ["SpeculativeConfig", "NgramProposer"]
