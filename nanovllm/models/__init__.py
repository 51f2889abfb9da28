"""Model registry keyed by the Hugging Face config's `architectures[0]`."""
from torch import nn
from transformers import PretrainedConfig

from nanovllm.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from nanovllm.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from nanovllm.models.qwen3 import Qwen3ForCausalLM
from nanovllm.models.pooling import PoolingDecoder
from nanovllm.models.qwen3_5 import (MULTIMODAL, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM,
                                     Qwen3NextForCausalLM)
from nanovllm.models.qwen3_moe import Qwen3MoeForCausalLM
from nanovllm.pooler_config import POOLING_SUFFIXES

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,   # its text model
    **MULTIMODAL,   # their text model (utils/text_config.py)
}


def get_model_class(hf_config: PretrainedConfig) -> type[nn.Module]:
    archs = getattr(hf_config, "architectures", None) or []
    arch = archs[0] if archs else None
    if arch not in MODEL_REGISTRY:
        raise ValueError(f"model architecture {arch!r} is not supported; "
                         f"supported: {', '.join(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[arch]


def decoder_of(arch: str) -> type[nn.Module]:
    """The registry class whose decoder a pooling architecture shares (Qwen3Model,
    Qwen3ForSequenceClassification -> Qwen3ForCausalLM)."""
    if arch in MODEL_REGISTRY:
        return MODEL_REGISTRY[arch]
    for suffix in POOLING_SUFFIXES:
        if arch.endswith(suffix) and f"{arch.removesuffix(suffix)}ForCausalLM" in MODEL_REGISTRY:
            return MODEL_REGISTRY[f"{arch.removesuffix(suffix)}ForCausalLM"]
    raise ValueError(f"model architecture {arch!r} is not supported for pooling; its decoder must be one of "
                     f"{', '.join(MODEL_REGISTRY)} (e.g. Qwen3Model, Qwen3ForSequenceClassification)")


def build_model(config) -> nn.Module:
    """The engine Config's model: the registry's class for its architecture, or, on the pooling
    runner, that decoder built for pooling (models/pooling.py)."""
    if config.pooling is not None:
        return PoolingDecoder(config.hf_config, config.pooling, decoder_of(config.pooling.architecture))
    return get_model_class(config.hf_config)(config.hf_config)
