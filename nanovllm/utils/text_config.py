"""Multimodal checkpoints whose text model nanovllm runs as a causal LM: the config it is built
from is the checkpoint's text_config (models/qwen3_5.py reads the weights under their prefix)."""
from transformers import PretrainedConfig

MULTIMODAL_ARCHITECTURES = frozenset({"Qwen3_5ForConditionalGeneration",
                                      "Qwen3_5MoeForConditionalGeneration",
                                      "Gemma3ForConditionalGeneration"})


def language_model_config(config: PretrainedConfig) -> PretrainedConfig:
    """A multimodal config's text_config, named by the multimodal architecture (the model registry's
    key; the top level decides whether the LM head is tied, as in transformers' multimodal model,
    and holds the quantization_config of Qwen's FP8 checkpoints); any other config as it is."""
    archs = getattr(config, "architectures", None) or []
    if not archs or archs[0] not in MULTIMODAL_ARCHITECTURES:
        return config
    text = config.text_config
    text.architectures = list(archs)
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", text.tie_word_embeddings))
    quantization = getattr(config, "quantization_config", None)
    if quantization and not getattr(text, "quantization_config", None):
        text.quantization_config = quantization
    return text
