"""Weights from *.safetensors (never pickles), mapped onto packed parameters; strict about
parameters left unset, shapes that differ and checkpoint tensors with nowhere to go."""
import glob
import json
import logging
import os
import re
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn

logger = logging.getLogger(__name__)

def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None):
    """Copy a checkpoint tensor into a parameter (or a slice of one) of exactly its shape."""
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: expected {tuple(param.shape)}, "
                         f"checkpoint has {tuple(loaded.shape)}")
    param.data.copy_(loaded)


@dataclass(frozen=True)
class CheckpointNames:
    """How a quantized checkpoint's tensor names differ from the model's parameters (a quantization
    format's, nanovllm/quantization)."""
    unread: tuple[str, ...] = ()      # suffixes of tensors the model does not use (static input scales)
    kv_scales: tuple[str, ...] = ()   # suffixes of static KV cache scales: kept in model.kv_scale_tensors
    renames: tuple[tuple[str, str], ...] = ()   # (checkpoint suffix, the parameter's suffix)


def _target(name: str, mapping: dict, names: CheckpointNames = CheckpointNames()) -> tuple[str, object]:
    """Checkpoint name -> (parameter name, shard id) through the model's packed_modules_mapping."""
    for old, new in names.renames:
        if name.endswith(old):
            name = name.removesuffix(old) + new
            break
    if (expert := expert_target(name)) is not None:
        return expert
    for key, (packed, shard_id) in mapping.items():
        if f".{key}." in name:
            return name.replace(f".{key}.", f".{packed}."), shard_id
    return name, None


def safetensors_files(path: str) -> list[str]:
    """The checkpoint's files: those named by model.safetensors.index.json when there is one (a
    folder may also hold a consolidated copy of the same tensors), else every *.safetensors."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return [os.path.join(path, name) for name in sorted(set(json.load(f)["weight_map"].values()))]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        pickles = sorted(os.path.basename(f) for pattern in ("*.bin", "*.pt", "*.pth")
                         for f in glob.glob(os.path.join(path, pattern)))
        found = f" (found {', '.join(pickles)}: pickled checkpoints are never loaded; re-save with " \
                "transformers' save_pretrained, which writes safetensors)" if pickles else ""
        raise FileNotFoundError(f"no *.safetensors files in {path!r}: "
                                f"only safetensors checkpoints are read{found}; "
                                "or pass load_format='dummy' for random weights")
    return files


def load_model(model: nn.Module, path: str, names: CheckpointNames = CheckpointNames()):
    """names: the quantization format's checkpoint names (skipped, kept aside, renamed)."""
    files = safetensors_files(path)
    params = dict(model.named_parameters())   # tied weights appear once
    mapping = getattr(model, "packed_modules_mapping", {})
    expected = {name: expert_shards(name, p) or _shards_of(name, mapping) for name, p in params.items()}
    loaded: dict[str, set] = {name: set() for name in params}
    unread, kv_names = names.unread, names.kv_scales
    model.kv_scale_tensors = {}   # static KV scales, for an FP8 cache (layers/attention.py: kv_scale_rows)
    # A model may skip parts of a checkpoint it does not run (a vision tower) and read its own
    # tensors under another prefix (a multimodal checkpoint's text model).
    skipped_prefixes = getattr(model, "skipped_checkpoint_prefixes", ())
    renames = getattr(model, "checkpoint_prefix_renames", {})
    skipped = 0
    for file in files:
        with safe_open(file, "pt", "cpu") as f:
            for key, ckpt_name in _loaded_as(model, f.keys()):
                if ckpt_name.endswith(unread):
                    continue
                if ckpt_name.startswith(skipped_prefixes):
                    skipped += 1
                    continue
                if ckpt_name.endswith(kv_names):
                    model.kv_scale_tensors[ckpt_name] = f.get_tensor(key)
                    continue
                prefix = next((p for p in renames if ckpt_name.startswith(p)), None)
                in_model = ckpt_name if prefix is None else renames[prefix] + ckpt_name[len(prefix):]
                name, shard_id = _target(in_model, mapping, names)
                if name not in params:
                    if _tied_duplicate(model, ckpt_name):
                        continue
                    raise ValueError(f"checkpoint tensor {ckpt_name!r} ({file}) matches no model parameter")
                param, tensor = params[name], f.get_tensor(key)
                if param.is_floating_point() and not tensor.is_floating_point():
                    # copy_ would cast the integers (or bools) to float and the model would make garbage.
                    raise ValueError(f"checkpoint tensor {ckpt_name!r} ({file}) has dtype {tensor.dtype}, "
                                     f"but the parameter is floating point ({param.dtype}): the checkpoint "
                                     "is broken or quantized in a format nanovllm does not read")
                if tensor.dtype == torch.float8_e4m3fn and param.dtype != tensor.dtype:
                    # copy_ would cast the FP8 values without their scale.
                    raise ValueError(f"checkpoint tensor {ckpt_name!r} ({file}) is FP8, but the parameter is "
                                     f"{param.dtype}: the config's quantization_config does not make this "
                                     "layer FP8 (or names it in its ignore list)")
                loader = getattr(param, "weight_loader", default_weight_loader)
                try:
                    loader(param, tensor, *(() if shard_id is None else (shard_id,)))
                except ValueError as e:
                    raise ValueError(f"checkpoint tensor {ckpt_name!r}: {e}") from None
                loaded[name].add(shard_id)
    if skipped:
        logger.info("skipped %d checkpoint tensors the model does not run (under %s)", skipped,
                    ", ".join(skipped_prefixes))
    missing = [ckpt for n in params for ckpt in _checkpoint_names(n, expected[n] - loaded[n], mapping)]
    if missing:
        raise ValueError(f"checkpoint {path!r} has no tensor for: {', '.join(missing[:10])}"
                         + (f" and {len(missing) - 10} more" if len(missing) > 10 else ""))


def _loaded_as(model: nn.Module, keys):
    """(key in the file, the name it loads as) for each tensor of a file: the key itself, unless the
    model maps it to other names, or to none (checkpoint_targets: models/pooling.py)."""
    targets = getattr(model, "checkpoint_targets", None)
    for key in keys:
        for name in (targets(key) if targets is not None else (key,)):
            yield key, name


def _shards_of(param_name: str, mapping: dict) -> set:
    shards = {shard for key, (packed, shard) in mapping.items() if f".{packed}." in param_name}
    return shards or {None}


def _checkpoint_names(param_name: str, shards: set, mapping: dict) -> list[str]:
    """The checkpoint tensor names that would have filled these shards of a parameter."""
    if _EXPERT_PARAM.search(param_name):
        return sorted(expert_checkpoint_name(param_name, shard) for shard in shards)
    names = []
    for shard in shards:
        key = next((k for k, (packed, s) in mapping.items() if s == shard and f".{packed}." in param_name),
                   None)
        names.append(param_name if key is None else param_name.replace(f".{mapping[key][0]}.", f".{key}."))
    return sorted(names)


# Mixture-of-experts checkpoints (transformers' Qwen3-MoE save_pretrained) store one tensor per
# expert and projection; the model stacks them: `...mlp.experts.{e}.gate_proj.weight` -> shard (e, 0)
# of `...mlp.experts.w13`, up_proj -> (e, 1), down_proj -> (e, 0) of `...mlp.experts.w2`.
# A quantized expert's other tensors go beside them: weight_scale -> w13_scale / w2_scale (FP8),
# any other leaf X (qweight, scales, weight_packed ...) -> w13_X / w2_X.
_EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$")
_EXPERT_SHARDS = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}
_EXPERT_PARAM = re.compile(r"\.experts\.(w13|w2)(_\w+)?$")


def expert_param_suffix(leaf: str) -> str:
    """The stacked parameter of a per-expert checkpoint leaf is w13 or w2 + this (weight: "", FP8
    scales: "_scale")."""
    return {"weight": "", "weight_scale": "_scale"}.get(leaf, "_" + leaf)


def expert_target(ckpt_name: str) -> tuple[str, tuple[int, int]] | None:
    """A per-expert checkpoint name -> (stacked parameter name, (expert, index)); None otherwise."""
    m = _EXPERT_NAME.search(ckpt_name)
    if m is None:
        return None
    stacked, index = _EXPERT_SHARDS[m[2]]
    return f"{ckpt_name[:m.start()]}.experts.{stacked}{expert_param_suffix(m[3])}", (int(m[1]), index)


def expert_shards(param_name: str, param: torch.Tensor) -> set | None:
    """Every shard a stacked expert parameter ([num_experts, ...]) needs; None for other parameters."""
    m = _EXPERT_PARAM.search(param_name)
    if m is None:
        return None
    return {(e, i) for e in range(param.shape[0]) for i in ((0, 1) if m[1] == "w13" else (0,))}


def expert_checkpoint_name(param_name: str, shard: tuple[int, int]) -> str:
    stacked, _, rest = param_name.rsplit(".", 1)[1].partition("_")
    proj = next(p for p, s in _EXPERT_SHARDS.items() if s == (stacked, shard[1]))
    suffix = {"": "weight", "scale": "weight_scale"}.get(rest, rest)
    return f"{param_name.rsplit('.', 1)[0]}.{shard[0]}.{proj}.{suffix}"


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


def resolve_model(model: str | os.PathLike, revision: str | None = None, weights: bool = True,
                  cache_dir: str | os.PathLike | None = None) -> str:
    """A local folder (a str or pathlib.Path; `~` is expanded) as is; anything else is a Hugging Face
    hub id, downloaded (safetensors only; weights=False: configuration and tokenizer files only) at
    `revision` (None: the default branch) into cache_dir (None: huggingface_hub's cache)."""
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str) or not model:
        raise TypeError(f"model must be a folder path or a hub id string, got {model!r}")
    model = os.path.expanduser(model)
    if os.path.isdir(model):
        return model
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise FileNotFoundError(f"model folder {model!r} does not exist "
                                "(and it is not a hub id like 'org/name')")
    from huggingface_hub import snapshot_download
    try:
        patterns = ["*.json", "*.txt", "*.model", "*.jinja"] + (["*.safetensors"] if weights else [])
        return snapshot_download(model, revision=revision, allow_patterns=patterns, cache_dir=cache_dir)
    except Exception as e:
        raise FileNotFoundError(
            f"{model!r} is not a local folder and could not be downloaded from the Hugging Face hub "
            f"({type(e).__name__}: {e}). Offline (or HF_HUB_OFFLINE=1)? Download it where there is a "
            f"network (e.g. `hf download {model} --local-dir DIR`) and pass the local "
            "folder DIR instead of the hub id.") from e
