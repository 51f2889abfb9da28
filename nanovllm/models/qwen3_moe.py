from torch import nn
from transformers import PretrainedConfig

from nanovllm.config import is_sparse_layer
from nanovllm.layers.fused_moe import SparseMoeBlock
from nanovllm.models.llama import LlamaMLP
from nanovllm.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE: the Qwen3 decoder whose MLP is a mixture of experts (router + top-k experts) in
    the layers the config's mlp_only_layers and decoder_sparse_step select, and dense elsewhere."""

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_index: int) -> nn.Module:
        return SparseMoeBlock(config) if is_sparse_layer(config, layer_index) else LlamaMLP(config)
