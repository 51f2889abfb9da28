"""Model registry keyed by the Hugging Face config's `architectures[0]`."""
from torch import nn
from transformers import PretrainedConfig

from nanovllm.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from nanovllm.models.qwen3 import Qwen3ForCausalLM
from nanovllm.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def get_model_class(hf_config: PretrainedConfig) -> type[nn.Module]:
    archs = getattr(hf_config, "architectures", None) or []
    arch = archs[0] if archs else None
    if arch not in MODEL_REGISTRY:
        raise ValueError(f"model architecture {arch!r} is not supported; "
                         f"supported: {', '.join(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[arch]


def build_model(config) -> nn.Module:
    """The engine Config's model: the registry's class for its architecture, or, on the pooling
    runner, that decoder built for pooling (nanovllm/pooling/model.py)."""
    if config.pooling is not None:
        from nanovllm.pooling.model import PoolingDecoder
        return PoolingDecoder(config.hf_config, config.pooling)
    return get_model_class(config.hf_config)(config.hf_config)
