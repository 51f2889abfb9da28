"""Engine options: strict (unknown names are a TypeError) and validated (bad values a ValueError)."""
import difflib
import logging
import math
import numbers
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch
from transformers import PretrainedConfig

from nanovllm.pooler_config import resolve_pooling
from nanovllm.speculative_config import SpeculativeConfig
from nanovllm.utils.hf_files import load_hf_config
from nanovllm.utils.text_config import language_model_config

logger = logging.getLogger(__name__)
# vLLM's spellings of the model dtype -> ours.
_DTYPE_NAMES = {"auto": "auto", "half": "float16", "float16": "float16", "bfloat16": "bfloat16",
                "float": "float32", "float32": "float32", torch.float16: "float16",
                torch.bfloat16: "bfloat16", torch.float32: "float32"}
# Prefill attention kernels (nanovllm.layers.prefill_attention says what each runs).
PREFILL_ATTENTION = ("auto", "flash_attn_4", "triton", "torch_flash")
# The deprecated attention_backend option's names -> prefill_attention's.
_ATTENTION_BACKEND_NAMES = {"auto": "auto", "flash_attn_4": "flash_attn_4", "triton": "torch_flash"}


@dataclass
class Config:
    model: str                                  # local folder (Config.create resolves a hub id)
    max_num_batched_tokens: int = 16384         # tokens computed in one step (prefill chunks share it)
    max_num_seqs: int = 512                     # sequences in one decode step
    max_model_len: int = 4096                   # prompt + output; capped by max_position_embeddings
    gpu_memory_utilization: float = 0.9        # share of GPU memory the engine may fill (CUDA)
    tensor_parallel_size: int = 1
    enforce_eager: bool = False                 # True: no CUDA graphs
    disable_custom_all_reduce: bool = False     # True: every TP all-reduce through NCCL (not only the
                                                # large ones; kernels/all_reduce.py does the decode-sized)
    enable_prefix_caching: bool = True          # share the KV blocks of identical prompt prefixes
    async_scheduling: bool = True               # schedule step N+1 while the device runs step N
    kvcache_block_size: int | None = None       # tokens per KV-cache block (None: 256, or block_size)
    num_kvcache_blocks: int | None = None       # fixed number of KV blocks (any device)
    kv_cache_memory_bytes: int | None = None    # KV-cache budget in bytes (any device; CPU default below)
    device: str = "auto"                        # "auto" (CUDA when available), "cuda", "cpu"
    dtype: str | torch.dtype = "auto"           # "auto": checkpoint dtype on CUDA, float32 on CPU;
                                                # also "half", "float16", "bfloat16", "float", "float32",
                                                # or a torch.dtype
    kv_cache_dtype: str = "auto"                # "auto": the model's dtype; "fp8" = "fp8_e4m3" (1 byte)
    calculate_kv_scales: bool = False           # fp8: K/V scales from the first prefill's amax (else 1.0,
                                                # or an FP8 checkpoint's static KV scales)
    prefill_attention: str = "auto"             # "auto" (FlashAttention-4 where it runs, else our Triton
                                                # kernel on sm90/sm100), or force "flash_attn_4", "triton" or
                                                # "torch_flash" (torch's FlashAttention-2)
    attention_backend: str | None = None        # deprecated: prefill_attention ("triton": "torch_flash")
    load_format: str = "auto"                   # "auto" (safetensors) or "dummy" (random weights)
    seed: int | None = 0                        # None: a random seed, drawn once
    tokenizer: str | None = None                # tokenizer folder or hub id; None: the model's
    tokenizer_mode: str = "auto"                # "auto" (fast tokenizer when there is one) or "slow"
    revision: str | None = None                 # hub revision (branch, tag or commit) of model and tokenizer
    trust_remote_code: bool = False             # accepted for vLLM scripts; remote code is never run
    disable_log_stats: bool = True              # False: log each generate call's throughput
    generation_config: str = "auto"             # "auto": the model's generation_config.json gives the
                                                # default SamplingParams; "vllm": ignore it; or a folder
    hf_overrides: dict[str, Any] | Callable | None = None   # set on the HF config after loading (a dict),
                                                # or a function of it that returns the config to use
    max_logprobs: int = 20                      # most logprobs / prompt_logprobs a request asks; -1: no cap
    skip_tokenizer_init: bool = False           # True: no tokenizer (token-id prompts, outputs without text)
    download_dir: str | None = None             # where hub downloads go (None: huggingface_hub's cache)
    enable_lora: bool = False                   # serve LoRA adapters (generate(..., lora_request=...))
    max_loras: int = 1                          # adapters in one batch (their GPU slots)
    max_lora_rank: int = 16                     # the largest adapter rank r accepted
    max_cpu_loras: int | None = None            # adapters kept read on the host (None: max_loras)
    speculative_config: dict[str, Any] | None = None   # vLLM's dict, e.g. {"method": "ngram",
                                                # "num_speculative_tokens": 3} (docs/speculative.md);
                                                # a SpeculativeConfig once validated
    # vLLM's names and settings that change nothing here, so vLLM scripts run unchanged:
    block_size: int | None = None               # vLLM's name for kvcache_block_size
    swap_space: float = 4                       # GiB of CPU swap in vLLM; preempted sequences are recomputed
    max_seq_len_to_capture: int = 8192          # CUDA graphs are captured per batch size, for any length
    enable_chunked_prefill: bool | None = None  # prefill is always chunked: None or True
    quantization: str | None = None             # None: as the checkpoint's quantization_config says (or
                                                # its quant_method); "fp8": also quantizes a bf16 checkpoint
                                                # (nanovllm/quantization reads it, before workers start)
    task: str = "auto"                          # "auto" or "generate": text generation
    runner: str = "auto"                        # "generate", "pooling" (embeddings, classifiers, scores:
                                                # docs/pooling.md) or "auto" (by the architecture's name)
    convert: str = "auto"                       # pooling: "embed", "classify", "reward" or "auto"
    pooler_config: dict[str, Any] | None = None   # pooling: a dict (or PoolerConfig) over the model's pooler
    hf_config: PretrainedConfig = field(init=False, repr=False)
    pooling: Any = field(init=False, repr=False)   # the pooling runner's PoolingSpec (None: generate)

    @classmethod
    def create(cls, model: str, **options) -> "Config":
        """Options checked by name first, then a hub id (model or tokenizer) resolved to a local folder."""
        model, tokenizer = cls.resolve(model, options)
        if tokenizer is not None:
            options["tokenizer"] = tokenizer
        return cls(model, **options)

    @classmethod
    def resolve(cls, model: str, options: dict, also_valid: tuple[str, ...] = ()) -> tuple[str, str | None]:
        """Checks the options' names (`also_valid`: a caller's own) and the revision, then resolves a
        hub id to a local folder: (the model's folder, the tokenizer option's folder or None)."""
        from nanovllm.utils.loader import resolve_model
        known = {f.name for f in fields(cls) if f.init} - {"model"}
        unknown = sorted(set(options) - known - set(also_valid))
        if unknown:
            raise TypeError(unknown_options_message(unknown, known | set(also_valid)))
        revision = options.get("revision")
        if revision is not None and not isinstance(revision, str):
            raise ValueError(f"revision must be a string (a branch, tag or commit) or None, got {revision!r}")
        folder = options.get("download_dir")
        model = resolve_model(model, revision, cache_dir=folder)
        tokenizer = options.get("tokenizer")
        return model, None if tokenizer is None else resolve_model(tokenizer, revision, weights=False,
                                                                   cache_dir=folder)

    def __getstate__(self):
        # hf_overrides is already applied to hf_config; a function (often a lambda) need not pickle
        # for the tensor-parallel workers.
        return {**self.__dict__, "hf_overrides": None}

    def __post_init__(self):
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        if isinstance(self.model, str):
            self.model = os.path.expanduser(self.model)
        if not os.path.isdir(self.model):
            raise FileNotFoundError(f"model folder {self.model!r} does not exist")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise FileNotFoundError(f"model folder {self.model!r} has no config.json")
        if self.block_size is not None:   # vLLM's name for it
            _check_int(self, "block_size", 1)
            if self.kvcache_block_size not in (None, self.block_size):
                raise ValueError(f"block_size={self.block_size} and kvcache_block_size="
                                 f"{self.kvcache_block_size} name the same setting: give one")
            self.kvcache_block_size = self.block_size
        if self.kvcache_block_size is None:
            self.kvcache_block_size = 256
        _vllm_no_ops(self)
        _check_int(self, "max_num_batched_tokens", 1)
        _check_int(self, "max_num_seqs", 1)
        _check_int(self, "max_model_len", 1)
        _check_int(self, "tensor_parallel_size", 1)
        _check_int(self, "kvcache_block_size", 1)
        self.block_size = self.kvcache_block_size
        if self.num_kvcache_blocks is not None:
            _check_int(self, "num_kvcache_blocks", 1)
        if self.kv_cache_memory_bytes is not None:
            _check_int(self, "kv_cache_memory_bytes", 1)
        if self.seed is None:
            self.seed = random.getrandbits(31)   # drawn once, so every TP rank gets the same
        _check_int(self, "seed", 0)
        _check_int(self, "max_logprobs", -1)
        _check_int(self, "max_loras", 1)
        _check_int(self, "max_lora_rank", 1)
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        _check_int(self, "max_cpu_loras", self.max_loras)
        if _is_bool(self.gpu_memory_utilization) or not isinstance(self.gpu_memory_utilization, numbers.Real):
            raise ValueError("gpu_memory_utilization must be a number in (0, 1], "
                             f"got {self.gpu_memory_utilization!r}")
        self.gpu_memory_utilization = float(self.gpu_memory_utilization)   # a numpy float too
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("enforce_eager", "disable_custom_all_reduce", "enable_prefix_caching",
                     "async_scheduling", "trust_remote_code", "disable_log_stats", "calculate_kv_scales",
                     "skip_tokenizer_init", "enable_lora"):
            if not _is_bool(getattr(self, name)):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
            setattr(self, name, bool(getattr(self, name)))
        if self.tokenizer is not None and not os.path.isdir(self.tokenizer):
            raise FileNotFoundError(f"tokenizer folder {self.tokenizer!r} does not exist")
        _check_choice(self, "device", ("auto", "cuda", "cpu"))
        if not isinstance(self.dtype, (str, torch.dtype)) or self.dtype not in _DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {tuple(k for k in _DTYPE_NAMES if isinstance(k, str))} "
                             f"or torch.float16/bfloat16/float32, got {self.dtype!r}")
        self.dtype = _DTYPE_NAMES[self.dtype]
        _check_choice(self, "tokenizer_mode", ("auto", "slow"))
        if not isinstance(self.generation_config, str) or not (
                self.generation_config in ("auto", "vllm") or os.path.isdir(self.generation_config)):
            raise ValueError("generation_config must be 'auto', 'vllm' or a folder with a "
                             f"generation_config.json, got {self.generation_config!r}")
        overrides = self.hf_overrides
        if overrides is not None and not (isinstance(overrides, dict) or callable(overrides)):
            raise ValueError(f"hf_overrides must be a dict or a function of the HF config, got {overrides!r}")
        if self.trust_remote_code:
            logger.warning("trust_remote_code=True: nanovllm never runs code from a model folder; models it "
                           "supports need none, and a model that needs remote code is refused")
        _check_choice(self, "load_format", ("auto", "dummy"))
        _check_choice(self, "kv_cache_dtype", ("auto", "fp8", "fp8_e4m3"))
        if self.attention_backend is not None:
            _take_attention_backend(self)
        _check_choice(self, "prefill_attention", PREFILL_ATTENTION)
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError("calculate_kv_scales=True scales an FP8 KV cache: also set kv_cache_dtype='fp8'")
        if self.device == "cuda" and self.kvcache_block_size % 16:
            raise ValueError("kvcache_block_size must be a multiple of 16 on CUDA, "
                             f"got {self.kvcache_block_size}")
        hf_config = apply_hf_overrides(load_hf_config(self.model), self.hf_overrides)
        self.hf_config = language_model_config(hf_config)
        self.max_model_len = min(self.max_model_len, self.hf_config.max_position_embeddings)
        self.pooling = resolve_pooling(self.model, self.hf_config, self.runner, self.convert,
                                       self.pooler_config, self.tokenizer)
        _check_tp_divides(self.hf_config, self.tensor_parallel_size)
        if self.quantization is not None and not isinstance(self.quantization, str):
            raise ValueError(f"quantization must be a method name (e.g. 'fp8', 'gptq') or None, "
                             f"got {self.quantization!r}")
        self.speculative_config = SpeculativeConfig.of(self.speculative_config)
        if self.speculative_config is not None and self.pooling is not None:
            raise ValueError("speculative_config is for text generation: a pooling model samples no tokens")
        if self.speculative_config is not None and is_hybrid(self.hf_config):
            raise ValueError("speculative_config: hybrid linear-attention models cannot roll their recurrent "
                             "state back past rejected drafts; pass speculative_config=None")


_warned_attention_backend = False


def _take_attention_backend(cfg: "Config"):
    """The deprecated attention_backend, mapped to prefill_attention (a warning, once a process)."""
    global _warned_attention_backend
    old = cfg.attention_backend
    if not isinstance(old, str) or old not in _ATTENTION_BACKEND_NAMES:
        raise ValueError(f"attention_backend (deprecated: use prefill_attention) must be one of "
                         f"{tuple(_ATTENTION_BACKEND_NAMES)}, got {old!r}")
    new = _ATTENTION_BACKEND_NAMES[old]
    if cfg.prefill_attention not in ("auto", new):
        raise ValueError(f"attention_backend={old!r} and prefill_attention={cfg.prefill_attention!r} "
                         "disagree: pass prefill_attention only (attention_backend is its deprecated name)")
    if not _warned_attention_backend:
        _warned_attention_backend = True
        logger.warning("attention_backend is deprecated: pass prefill_attention=%r instead of "
                       "attention_backend=%r", new, old)
    cfg.prefill_attention, cfg.attention_backend = new, None


def _vllm_no_ops(cfg: "Config"):
    """vLLM options that nanovllm takes at the values that mean what it always does."""
    if _is_bool(cfg.swap_space) or not isinstance(cfg.swap_space, numbers.Real) or cfg.swap_space < 0:
        raise ValueError(f"swap_space must be a number of GiB >= 0, got {cfg.swap_space!r}")
    _check_int(cfg, "max_seq_len_to_capture", 1)
    if cfg.enable_chunked_prefill not in (None, True):
        raise ValueError("enable_chunked_prefill: nanovllm always chunks long prefills (within "
                         f"max_num_batched_tokens); pass None or True, got {cfg.enable_chunked_prefill!r}")
    _check_choice(cfg, "task", ("auto", "generate"))
    if cfg.download_dir is not None and not isinstance(cfg.download_dir, (str, os.PathLike)):
        raise ValueError(f"download_dir must be a folder path or None, got {cfg.download_dir!r}")


def unknown_options_message(unknown: list[str], valid: set[str]) -> str:
    """'unknown option 'max_num_seq' (did you mean 'max_num_seqs'?); valid options are: ...'."""
    named = []
    for name in unknown:
        close = difflib.get_close_matches(name, valid, n=1)
        named.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    return (f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(named)}; "
            f"valid options are: {', '.join(sorted(valid))}")


def uses_cuda(config: Config) -> bool:
    """Do the engine's ranks run on CUDA? device="auto" means CUDA when torch sees a GPU. The one
    rule for rank 0's runner, its handle on the workers and the workers themselves."""
    return config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())


def num_experts_of(config: PretrainedConfig) -> int:
    """The experts per MoE layer; 0 for a dense model."""
    # transformers 5 stores Qwen3-MoE's num_experts as num_local_experts (an attribute alias)
    return getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0


def is_sparse_layer(config: PretrainedConfig, layer_index: int) -> bool:
    """transformers' rule: experts unless the layer is in mlp_only_layers, and then only every
    decoder_sparse_step-th layer (1: all of them)."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_index not in (getattr(config, "mlp_only_layers", None) or [])
            and num_experts_of(config) > 0 and (layer_index + 1) % step == 0)


def _check_tp_divides(hf_config: PretrainedConfig, tp: int):
    """Refuse a tensor_parallel_size that does not split the model's heads and MLP evenly, before
    any worker starts (the sharded layers check again as they are built)."""
    heads = getattr(hf_config, "num_attention_heads", None)
    sizes = {"num_attention_heads": heads,
             "num_key_value_heads": getattr(hf_config, "num_key_value_heads", None) or heads}
    # the models' own rule for which layers have experts (the rest have a dense MLP)
    sparse = [is_sparse_layer(hf_config, i) for i in range(getattr(hf_config, "num_hidden_layers", 0) or 0)]
    if any(sparse):
        sizes["moe_intermediate_size"] = getattr(hf_config, "moe_intermediate_size", None)
    if not sparse or not all(sparse):   # a dense model, or dense layers beside the experts
        sizes["intermediate_size"] = getattr(hf_config, "intermediate_size", None)
    for name in ("linear_num_key_heads", "linear_num_value_heads", "shared_expert_intermediate_size"):
        sizes[name] = getattr(hf_config, name, None)   # linear attention (Qwen3.5), a shared expert
    sizes = {name: n for name, n in sizes.items() if isinstance(n, int) and n > 0}
    for name, n in sizes.items():
        if n % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {name} ({n}); "
                             f"sizes that divide {', '.join(f'{k} ({v})' for k, v in sizes.items())}: "
                             f"{', '.join(map(str, tp_sizes_that_divide(sizes.values())))}")


def tp_sizes_that_divide(sizes) -> list[int]:
    """The tensor_parallel_sizes that split every one of `sizes` evenly: the divisors of their gcd."""
    common = math.gcd(*sizes)
    return [d for d in range(1, common + 1) if common % d == 0]


def is_hybrid(hf_config: PretrainedConfig) -> bool:
    """A hybrid linear-attention model (Qwen3.5, Qwen3-Next): some of its layer_types are
    'linear_attention'."""
    return "linear_attention" in (getattr(hf_config, "layer_types", None) or ())


def _check_int(cfg: Config, name: str, minimum: int):
    value = getattr(cfg, name)
    if _is_bool(value) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    setattr(cfg, name, int(value))   # a numpy integer too


def _is_bool(value) -> bool:
    return isinstance(value, (bool, np.bool_))


def _check_choice(cfg: Config, name: str, choices: tuple):
    if getattr(cfg, name) not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {getattr(cfg, name)!r}")


def apply_hf_overrides(hf_config: PretrainedConfig, overrides) -> PretrainedConfig:
    """vLLM's hf_overrides: a dict's values set on the config (a dict value updates a sub-config
    that is itself a config), or a function that returns the config to use."""
    if overrides is None:
        return hf_config
    if callable(overrides):
        hf_config = overrides(hf_config)
        if not isinstance(hf_config, PretrainedConfig):
            raise ValueError(f"hf_overrides must return the HF config, got {type(hf_config).__name__}")
        return hf_config
    for key, value in overrides.items():
        current = getattr(hf_config, key, None)
        if isinstance(value, dict) and isinstance(current, PretrainedConfig):
            for k, v in value.items():
                setattr(current, k, v)
        else:
            setattr(hf_config, key, value)
    return hf_config
