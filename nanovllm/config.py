"""Engine options: strict (unknown names are a TypeError) and validated (bad values a ValueError)."""
import numbers
import os
from dataclasses import dataclass, field, fields

import numpy as np
from transformers import PretrainedConfig

from nanovllm.utils.hf_files import load_hf_config


@dataclass
class Config:
    model: str                                  # local folder (a hub id is resolved before Config)
    max_num_batched_tokens: int = 16384         # tokens computed in one step (prefill chunks share it)
    max_num_seqs: int = 512                     # sequences in one decode step
    max_model_len: int = 4096                   # prompt + output; capped by max_position_embeddings
    gpu_memory_utilization: float = 0.9        # share of GPU memory the engine may fill (CUDA)
    tensor_parallel_size: int = 1
    enforce_eager: bool = False                 # True: no CUDA graphs
    enable_prefix_caching: bool = True          # share the KV blocks of identical prompt prefixes
    async_scheduling: bool = True               # schedule step N+1 while the device runs step N
    kvcache_block_size: int = 256               # tokens per KV-cache block
    num_kvcache_blocks: int | None = None       # fixed number of KV blocks (any device)
    kv_cache_memory_bytes: int | None = None    # KV-cache budget in bytes (any device; CPU default below)
    device: str = "auto"                        # "auto" (CUDA when available), "cuda", "cpu"
    dtype: str = "auto"                         # "auto": checkpoint dtype on CUDA, float32 on CPU
    kv_cache_dtype: str = "auto"                # "auto": the model's dtype; "fp8" = "fp8_e4m3" (1 byte)
    calculate_kv_scales: bool = False           # fp8: K/V scales from the first prefill's amax (else 1.0)
    load_format: str = "auto"                   # "auto" (safetensors) or "dummy" (random weights)
    seed: int = 0
    tokenizer: str | None = None                # tokenizer folder (default: the model's)
    hf_config: PretrainedConfig = field(init=False, repr=False)

    @classmethod
    def create(cls, model: str, **options) -> "Config":
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(map(repr, unknown))}; "
                            f"valid options are: {', '.join(sorted(known - {'model'}))}")
        return cls(model, **options)

    def __post_init__(self):
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        if isinstance(self.model, str):
            self.model = os.path.expanduser(self.model)
        if not os.path.isdir(self.model):
            raise FileNotFoundError(f"model folder {self.model!r} does not exist")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise FileNotFoundError(f"model folder {self.model!r} has no config.json")
        _check_int(self, "max_num_batched_tokens", 1)
        _check_int(self, "max_num_seqs", 1)
        _check_int(self, "max_model_len", 1)
        _check_int(self, "tensor_parallel_size", 1)
        _check_int(self, "kvcache_block_size", 1)
        if self.num_kvcache_blocks is not None:
            _check_int(self, "num_kvcache_blocks", 1)
        if self.kv_cache_memory_bytes is not None:
            _check_int(self, "kv_cache_memory_bytes", 1)
        _check_int(self, "seed", 0)
        if _is_bool(self.gpu_memory_utilization) or not isinstance(self.gpu_memory_utilization, numbers.Real):
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {self.gpu_memory_utilization!r}")
        self.gpu_memory_utilization = float(self.gpu_memory_utilization)   # a numpy float too
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("enforce_eager", "enable_prefix_caching", "async_scheduling", "calculate_kv_scales"):
            if not _is_bool(getattr(self, name)):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
            setattr(self, name, bool(getattr(self, name)))
        if self.tokenizer is not None and not os.path.isdir(self.tokenizer):
            raise FileNotFoundError(f"tokenizer folder {self.tokenizer!r} does not exist")
        _check_choice(self, "device", ("auto", "cuda", "cpu"))
        _check_choice(self, "dtype", ("auto", "float32", "bfloat16", "float16"))
        _check_choice(self, "load_format", ("auto", "dummy"))
        _check_choice(self, "kv_cache_dtype", ("auto", "fp8", "fp8_e4m3"))
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError("calculate_kv_scales=True scales an FP8 KV cache: also set kv_cache_dtype='fp8'")
        if self.device == "cuda" and self.kvcache_block_size % 16:
            raise ValueError(f"kvcache_block_size must be a multiple of 16 on CUDA, got {self.kvcache_block_size}")
        self.hf_config = load_hf_config(self.model)
        self.max_model_len = min(self.max_model_len, self.hf_config.max_position_embeddings)


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

