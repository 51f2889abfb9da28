"""PEFT LoRA folders: adapter_config.json + adapter_model.safetensors, checked against the model
(check_adapter, when a request arrives: nothing is queued if it fails) and read (load_adapter).

PEFT names a layer's matrices base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight
([r, in]) and ...lora_B.weight ([out, r]); the update is scale * B A x with scale lora_alpha / r
(lora_alpha / sqrt(r) with use_rslora)."""
import json
import math
import os
import re
from dataclasses import dataclass

import torch
from safetensors import safe_open

from nanovllm.config import is_hybrid
from nanovllm.lora.request import LoRARequest

# PEFT's module name -> (the decoder block's sub-module, our fused layer, its slice)
TARGETS = {"q_proj": ("self_attn", "qkv_proj", 0), "k_proj": ("self_attn", "qkv_proj", 1),
           "v_proj": ("self_attn", "qkv_proj", 2), "o_proj": ("self_attn", "o_proj", 0),
           "gate_proj": ("mlp", "gate_up_proj", 0), "up_proj": ("mlp", "gate_up_proj", 1),
           "down_proj": ("mlp", "down_proj", 0)}
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
WEIGHTS = "adapter_model.safetensors"


# The linear-attention layers' projections (Qwen3.5, Qwen3-Next), which take no LoRA here.
LINEAR_ATTENTION = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba",
                    "out_proj")


def module_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """PEFT module name -> (in_features, out_features) of the whole (unsharded) layer."""
    hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = getattr(hf_config, "intermediate_size", None)
    q_rows = (2 if is_hybrid(hf_config) else 1) * heads * head_dim   # a hybrid's q_proj: query and gate
    return {"q_proj": (hidden, q_rows), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


@dataclass(frozen=True)
class AdapterInfo:
    rank: int
    scale: float
    modules: frozenset[str]   # PEFT module names with weights in the file


def check_adapter(request: LoRARequest, hf_config, max_lora_rank: int,
                  lora_modules: frozenset[str] = frozenset(TARGETS)) -> AdapterInfo:
    """Read the folder's config and the file's tensor names and shapes (not the tensors), and refuse
    what the engine cannot serve with the error that says what to change. lora_modules: the PEFT
    module names the model takes LoRA on (no MLP ones for mixture-of-experts layers)."""
    where = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    folder = request.lora_path
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{where}: the folder does not exist")
    config_file, weights = os.path.join(folder, "adapter_config.json"), os.path.join(folder, WEIGHTS)
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"{where}: no adapter_config.json (a PEFT adapter folder has one)")
    if not os.path.isfile(weights):
        bin_file = os.path.isfile(os.path.join(folder, "adapter_model.bin"))
        raise FileNotFoundError(f"{where}: no {WEIGHTS}" + (
            " (adapter_model.bin is a pickle, which nanovllm does not read: save the adapter with "
            "safe_serialization=True)" if bin_file else ""))
    with open(config_file) as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {cfg.get('peft_type')!r} is not LoRA")
    for key, ok in (("use_dora", not cfg.get("use_dora")), ("rank_pattern", not cfg.get("rank_pattern")),
                    ("alpha_pattern", not cfg.get("alpha_pattern")),
                    ("modules_to_save", not cfg.get("modules_to_save")),
                    ("fan_in_fan_out", not cfg.get("fan_in_fan_out")),
                    ("bias", cfg.get("bias", "none") == "none")):
        if not ok:
            raise ValueError(f"{where}: {key}={cfg.get(key)!r} is not supported (plain LoRA on linear "
                             "layers, one rank and alpha for all)")
    rank = cfg.get("r")
    if type(rank) is not int or rank < 1:
        raise ValueError(f"{where}: adapter_config.json's r must be an integer >= 1, got {rank!r}")
    if rank > max_lora_rank:
        raise ValueError(f"{where}: its rank r={rank} is more than max_lora_rank={max_lora_rank}; "
                         f"raise LLM(max_lora_rank=...) to at least {rank}")
    targets = cfg.get("target_modules") or []
    if isinstance(targets, (list, tuple)):
        unknown = sorted(set(targets) - lora_modules)
        if unknown:
            linear = " (the linear-attention layers' projections take no LoRA in nanovllm)" if set(
                unknown) & set(LINEAR_ATTENTION) else ""
            raise ValueError(f"{where}: target module(s) {unknown} are not layers this model takes LoRA "
                             f"on ({', '.join(sorted(lora_modules, key=list(TARGETS).index))}){linear}")
    alpha = cfg.get("lora_alpha", rank)
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    shapes, num_layers = module_shapes(hf_config), hf_config.num_hidden_layers
    linear_layers = {i for i, kind in enumerate(getattr(hf_config, "layer_types", None) or ())
                     if kind == "linear_attention"}   # a hybrid's, which have no self_attn
    modules, halves = set(), {}
    with safe_open(weights, "pt") as f:
        for key in f.keys():
            m = _KEY.fullmatch(key)
            if m is None:
                raise ValueError(f"{where}: tensor {key!r} is not a LoRA matrix of a decoder layer "
                                 "(base_model.model.model.layers.N.<self_attn|mlp>.<module>.lora_A/B.weight)")
            layer, block, module, ab = int(m[1]), m[2], m[3], m[4]
            if (module not in lora_modules or TARGETS[module][0] != block or layer >= num_layers
                    or (block == "self_attn" and layer in linear_layers)):
                raise ValueError(f"{where}: tensor {key!r} targets a module the model lacks (it has "
                                 f"{num_layers} layers and takes LoRA on "
                                 f"{', '.join(sorted(lora_modules, key=list(TARGETS).index))})")
            fan_in, fan_out = shapes[module]
            want = (rank, fan_in) if ab == "A" else (fan_out, rank)
            got = tuple(f.get_slice(key).get_shape())
            if got != want:
                raise ValueError(f"{where}: tensor {key!r} has shape {got}, but r={rank} on this model "
                                 f"needs {want}")
            modules.add(module)
            halves.setdefault((layer, module), set()).add(ab)
    half = next((k for k, v in halves.items() if len(v) == 1), None)
    if half is not None:
        raise ValueError(f"{where}: layer {half[0]} {half[1]} has only lora_{''.join(halves[half])}")
    if not modules:
        raise ValueError(f"{where}: {WEIGHTS} holds no LoRA matrices")
    return AdapterInfo(rank, scale, frozenset(modules))


def load_adapter(request: LoRARequest,
                 info: AdapterInfo) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer index, PEFT module name) -> (A [r, in], scale * B [out, r]) in fp32 on the CPU, of a
    checked adapter."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(os.path.join(request.lora_path, WEIGHTS), "pt") as f:
        for key in f.keys():
            m = _KEY.fullmatch(key)
            halves.setdefault((int(m[1]), m[3]), {})[m[4]] = f.get_tensor(key).float()
    return {where: (pair["A"], pair["B"] * info.scale) for where, pair in halves.items()}
