"""Weights from *.safetensors (never pickles), mapped onto packed parameters; strict about
parameters left unset, shapes that differ and checkpoint tensors with nowhere to go."""
import glob
import os

import torch
from safetensors import safe_open
from torch import nn


def _default_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None):
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: expected {tuple(param.shape)}, checkpoint has {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def _target(name: str, mapping: dict) -> tuple[str, object]:
    """Checkpoint name -> (parameter name, shard id) through the model's packed_modules_mapping."""
    for key, (packed, shard_id) in mapping.items():
        if f".{key}." in name:
            return name.replace(f".{key}.", f".{packed}."), shard_id
    return name, None


def load_model(model: nn.Module, path: str):
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path!r} (only safetensors checkpoints are read)")
    params = dict(model.named_parameters())   # tied weights appear once
    mapping = getattr(model, "packed_modules_mapping", {})
    expected = {name: _shards_of(name, mapping) for name in params}
    loaded: dict[str, set] = {name: set() for name in params}
    for file in files:
        with safe_open(file, "pt", "cpu") as f:
            for ckpt_name in f.keys():
                name, shard_id = _target(ckpt_name, mapping)
                if name not in params:
                    if _tied_duplicate(model, ckpt_name):
                        continue
                    raise ValueError(f"checkpoint tensor {ckpt_name!r} ({file}) matches no model parameter")
                param = params[name]
                loader = getattr(param, "weight_loader", _default_loader)
                try:
                    loader(param, f.get_tensor(ckpt_name), *(() if shard_id is None else (shard_id,)))
                except ValueError as e:
                    raise ValueError(f"checkpoint tensor {ckpt_name!r}: {e}") from None
                loaded[name].add(shard_id)
    missing = [n for n in params if loaded[n] != expected[n]]
    if missing:
        raise ValueError(f"checkpoint {path!r} leaves parameters unset: {', '.join(missing[:10])}"
                         + (f" and {len(missing) - 10} more" if len(missing) > 10 else ""))


def _shards_of(param_name: str, mapping: dict) -> set:
    shards = {shard for key, (packed, shard) in mapping.items() if f".{packed}." in param_name}
    return shards or {None}


def _tied_duplicate(model: nn.Module, ckpt_name: str) -> bool:
    """lm_head.weight in a checkpoint whose model ties it to the embedding (already loaded)."""
    return ckpt_name == "lm_head.weight" and getattr(getattr(model, "lm_head", None), "weight", None) is \
        getattr(getattr(getattr(model, "model", None), "embed_tokens", None), "weight", False)


def load_dummy_weights(model: nn.Module, seed: int = 0):
    """Random weights for benchmarks without a checkpoint: norms 1, everything else small noise."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if param.dim() == 1 and "norm" in name:
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, 0.02, generator=gen)


def resolve_model(model: str) -> str:
    """A local folder as is; anything else is a Hugging Face hub id, downloaded (safetensors only)."""
    if not isinstance(model, str) or not model:
        raise TypeError(f"model must be a folder path or a hub id string, got {model!r}")
    if os.path.isdir(model):
        return model
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise FileNotFoundError(f"model folder {model!r} does not exist (and it is not a hub id like 'org/name')")
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"])
    except Exception as e:
        raise FileNotFoundError(
            f"{model!r} is not a local folder and could not be downloaded from the Hugging Face hub "
            f"({type(e).__name__}: {e}). Offline? Download it elsewhere and pass its local folder.") from e
