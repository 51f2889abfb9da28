"""Speculative decoding: n-gram drafts from a sequence's own tokens (ngram.py), checked against the
target model in one step of k + 1 query rows per sequence (verify.py), under vLLM's
speculative_config (nanovllm/speculative_config.py, beside the other options). docs/speculative.md
tells the whole story."""
from nanovllm.spec.ngram import NgramProposer
from nanovllm.speculative_config import SpeculativeConfig

__all__ = ["SpeculativeConfig", "NgramProposer"]
