"""Quantized weights: the registry of checkpoint formats, choosing one, and putting its methods on a
model's layers around loading (the interface is in quantization/base.py)."""
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.config import Config, is_hybrid
from nanovllm.layers.fused_moe import FusedMoE
from nanovllm.layers.linear import LinearBase, ReplicatedLinear
from nanovllm.quantization.awq import awq_config
from nanovllm.quantization.base import LinearMethod, MoEMethod, QuantizationConfig
from nanovllm.quantization.compressed_tensors import compressed_tensors_config
from nanovllm.quantization.fbgemm_fp8 import fbgemm_fp8_config
from nanovllm.quantization.fp8 import Fp8Config
from nanovllm.quantization.gptq import gptq_config
from nanovllm.utils.loader import CheckpointNames

logger = logging.getLogger(__name__)

# A checkpoint's quant_method -> its format read from the quantization_config dict.
METHODS: dict[str, Callable[[dict], QuantizationConfig]] = {
    "fp8": Fp8Config.from_config,
    "fbgemm_fp8": fbgemm_fp8_config,
    "compressed-tensors": compressed_tensors_config,
    "gptq": gptq_config,
    "awq": awq_config,
}


def get_quantization_config(hf_config: PretrainedConfig,
                            quantization: str | None) -> QuantizationConfig | None:
    """The format the model's weights are in, from its quantization_config (quantization: the engine
    option, None or the same quant_method; 'fp8' also quantizes an unquantized checkpoint at load), or
    None (unquantized). Anything not run is a ValueError that names what is supported."""
    supported = ", ".join(map(repr, METHODS))
    if quantization is not None and quantization not in METHODS:
        raise ValueError(f"quantization={quantization!r} is not supported: pass None (the checkpoint's "
                         f"quantization_config decides) or one of {supported} ('fp8' also quantizes an "
                         "unquantized checkpoint at load)")
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    if not qc:
        if quantization is None:
            return None
        if quantization != "fp8":
            raise ValueError(f"quantization={quantization!r} needs a checkpoint in that format; the model's "
                             "config.json has no quantization_config (pass quantization='fp8' to quantize "
                             "an unquantized checkpoint at load)")
        return Fp8Config.at_load()
    method = qc.get("quant_method")
    if quantization is not None and method in METHODS and quantization != method:
        raise ValueError(f"quantization={quantization!r}, but the checkpoint's quantization_config says "
                         f"{method!r}: pass quantization=None (or {method!r}) to read it as it is")
    if method not in METHODS:
        raise ValueError(f"the checkpoint's quantization_config has quant_method {method!r}, which nanovllm "
                         f"does not run; supported: {supported}")
    return METHODS[method](qc)


def quantization_of(config: Config) -> QuantizationConfig | None:
    """get_quantization_config of an engine Config (its model's hf_config, its quantization option)."""
    return get_quantization_config(config.hf_config, config.quantization)


def check_quantization(config: Config) -> QuantizationConfig | None:
    """quantization_of(config), before any worker starts, with a warning for static KV scales that a
    cache in the model's dtype does not use."""
    quant = quantization_of(config)
    if quant is not None and is_hybrid(config.hf_config) and not isinstance(quant, Fp8Config):
        raise ValueError(f"{type(quant).__name__} (integer weights) is not supported for hybrid linear-"
                         "attention models (Qwen3.5, Qwen3-Next): their gated q_proj and linear-attention "
                         "projections reorder rows on load, which packed integer weights cannot follow; "
                         "use an FP8 or a bf16 checkpoint (quantization='fp8' quantizes one at load)")
    if quant is not None and quant.names.kv_scales and config.kv_cache_dtype == "auto":
        logger.warning("the checkpoint's static KV cache scales (kv_cache_scheme) are not used: they "
                       "scale an FP8 KV cache, kv_cache_dtype='fp8'")
    return quant


# ---- the methods on a model's layers ------------------------------------------------------------

@dataclass
class QuantPlan:
    layers: list[tuple[nn.Module, LinearMethod | MoEMethod]]   # each quantized layer and its method
    loaded: bool   # its weights are read in the format (else loaded as floats, quantized after)
    names: CheckpointNames = CheckpointNames()   # for the loader: tensors skipped, kept aside, renamed


def quantized_modules(model: nn.Module, quant: QuantizationConfig) -> list[tuple[nn.Module, LinearMethod
                                                                                 | MoEMethod]]:
    """(module, method) of every layer the format quantizes: sharded linear layers and FusedMoE. A
    packed layer (qkv_proj, gate_up_proj) is quantized unless the ignore list names all its checkpoint
    projections (some of them: ValueError)."""
    mapping = getattr(model, "packed_modules_mapping", {})
    renames = getattr(model, "checkpoint_prefix_renames", {})

    def ignored(module_name: str) -> bool:   # by our name or the checkpoint's (model.language_model.)
        return quant.ignores(module_name) or any(
            quant.ignores(theirs + module_name[len(ours):])
            for theirs, ours in renames.items() if module_name.startswith(ours))
    chosen = []
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            if not ignored(name) and (method := quant.moe_method(name, module)) is not None:
                chosen.append((module, method))
        elif isinstance(module, LinearBase) and not isinstance(module, ReplicatedLinear):
            prefix, _, leaf = name.rpartition(".")
            parts = [f"{prefix}.{key}" for key, (packed, _) in mapping.items() if packed == leaf] or [name]
            kept = [ignored(p) for p in parts]
            if any(kept) and not all(kept):
                raise ValueError(f"the checkpoint's ignore list keeps some of {parts} unquantized, not all: "
                                 f"nanovllm packs them into one layer ({name}) and needs one format for it")
            if not any(kept) and (method := quant.linear_method(name, module)) is not None:
                chosen.append((module, method))
    return chosen


def prepare_model(model: nn.Module, quant: QuantizationConfig | None, load_format: str) -> QuantPlan:
    """Before loading: each quantized layer's method, and, when the weights are read in the format,
    the format's empty parameters in place of the layer's (dummy weights or an unquantized checkpoint
    load as floats, for finish_loading to quantize)."""
    if quant is None:
        return QuantPlan([], loaded=False)
    loaded = quant.reads_checkpoint and load_format != "dummy"
    plan = QuantPlan(quantized_modules(model, quant), loaded, quant.names)
    if plan.loaded:
        for module, method in plan.layers:
            method.create_weights(module)
            module.quant = method
    return plan


def finish_loading(model: nn.Module, plan: QuantPlan):
    """After loading: fold the RMSNorm weights into the GEMMs where the model can (models/llama.py;
    not into quantized weights), then each method's last step (quantizing weights loaded as floats:
    quantization='fp8' or dummy weights), so folded weights are quantized once."""
    if hasattr(model, "fold_norms"):
        model.fold_norms()
    for module, method in plan.layers:
        with torch.no_grad():
            method.process_weights_after_loading(module, plan.loaded)
        module.quant = method
