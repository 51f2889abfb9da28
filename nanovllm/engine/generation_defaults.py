"""The default SamplingParams of a model, from its generation_config.json, as vLLM derives them."""
import os

from transformers import GenerationConfig

# generation_config.json keys vLLM carries into the default SamplingParams -> their SamplingParams name.
_SAMPLING_KEYS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_k": "top_k",
                  "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}


def default_sampling_overrides(model_folder: str, generation_config: str) -> dict:
    """SamplingParams fields the model's generation config sets: as vLLM reads them, only values
    that differ from transformers' GenerationConfig defaults. generation_config: "auto" (the model
    folder), "vllm" (none) or another folder."""
    if generation_config == "vllm":
        return {}
    folder = model_folder if generation_config == "auto" else generation_config
    if not os.path.isfile(os.path.join(folder, "generation_config.json")):
        return {}
    diff = GenerationConfig.from_pretrained(folder, trust_remote_code=False).to_diff_dict()
    return {ours: diff[key] for key, ours in _SAMPLING_KEYS.items() if diff.get(key) is not None}
