"""A model folder's JSON files, read strictly (a broken file is an error naming it), and the
rule that no code from a model folder ever runs: every transformers call that reads the folder
passes trust_remote_code=False, and a folder that cannot load without its own code is refused."""
import json
import math
import numbers
import os

from huggingface_hub.errors import StrictDataclassError
from transformers import CONFIG_MAPPING, AutoConfig, AutoTokenizer, PretrainedConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_TOKENIZER_JSON = ("tokenizer_config.json", "tokenizer.json", "special_tokens_map.json", "vocab.json",
                   "added_tokens.json")


def read_json(path: str) -> dict:
    """The JSON object in a file; a ValueError naming the file when it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:   # JSONDecodeError is a ValueError
        raise ValueError(f"{path} is not valid JSON ({e}); restore the file (download the model again)") \
            from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def load_hf_config(folder: str) -> PretrainedConfig:
    """config.json as transformers' config class for its model_type, never a class from the folder."""
    raw = read_json(os.path.join(folder, "config.json"))
    if "auto_map" in raw and raw.get("model_type") not in CONFIG_MAPPING:
        # transformers would need the folder's own Python code (and may ask on stdin whether to run it).
        raise ValueError(
            f"the model in {folder!r} needs its own Python code (config.json has auto_map and model_type "
            f"{raw.get('model_type')!r}, which transformers does not know); nanovllm never runs code from a "
            "model folder: use a model whose architecture transformers and nanovllm support")
    where = os.path.join(folder, "config.json")
    check_config_values(raw, where)   # before transformers, whose own checks vary by version and model
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except ValueError as e:
        _raise_if_remote_code(folder, e)
        raise
    except StrictDataclassError as e:   # transformers' own checks of the values (not a ValueError)
        raise ValueError(f"{where}: {e}") from e
    check_head_counts(config, where)
    return config


# Sizes that must be positive integers when config.json gives them.
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "max_position_embeddings")


def check_config_values(raw: dict, where: str):
    """A non-positive size or epsilon loads in transformers and gives garbage or a crash deep in the
    model; refuse it, naming the field."""
    for name in _SIZES:
        value = raw.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{where}: {name} must be an integer >= 1, got {value!r}")
    rope = raw.get("rope_parameters")
    theta = rope["rope_theta"] if isinstance(rope, dict) and "rope_theta" in rope else raw.get("rope_theta")
    for name, value in (("rms_norm_eps", raw.get("rms_norm_eps")), ("rope_theta", theta)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                                  or not 0 < value < math.inf):
            raise ValueError(f"{where}: {name} must be a number > 0, got {value!r}")


def check_head_counts(config: PretrainedConfig, where: str):
    heads = getattr(config, "num_attention_heads", None)
    if heads is None:
        return
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise ValueError(f"{where}: num_attention_heads ({heads}) must be a multiple of "
                         f"num_key_value_heads ({kv_heads})")
    if getattr(config, "head_dim", None) is None and config.hidden_size % heads:
        raise ValueError(f"{where}: hidden_size ({config.hidden_size}) must be a multiple of "
                         f"num_attention_heads ({heads}) when head_dim is not given")


def load_tokenizer(folder: str, mode: str = "auto"):
    """The folder's tokenizer, or None when it has none (then prompts must be token ids).
    mode "slow": the Python tokenizer even where a fast one exists (vLLM's tokenizer_mode)."""
    if not any(os.path.exists(os.path.join(folder, f)) for f in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=False, use_fast=mode != "slow")
    except Exception as e:
        for name in _TOKENIZER_JSON:   # transformers' errors for a broken file rarely name it
            if os.path.isfile(os.path.join(folder, name)):
                read_json(os.path.join(folder, name))
        _raise_if_remote_code(folder, e)
        raise


def generation_eos_token_id(folder: str):
    """eos_token_id from generation_config.json (an int, a list of ints or None)."""
    path = os.path.join(folder, "generation_config.json")
    return read_json(path).get("eos_token_id") if os.path.isfile(path) else None


def _raise_if_remote_code(folder: str, e: Exception):
    """transformers' refusal of remote code tells the user to pass trust_remote_code=True, which
    nanovllm does not take: say what is true here instead."""
    if isinstance(e, ValueError) and "trust_remote_code" in str(e):
        raise ValueError(f"the model in {folder!r} needs its own Python code (auto_map); nanovllm never "
                         "runs code from a model folder") from e
