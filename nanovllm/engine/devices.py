"""Where and in what the model runs: the device, the model's dtype and the KV cache's, from Config."""
from contextlib import contextmanager

import torch

from nanovllm.config import Config, uses_cuda

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(config: Config) -> torch.device:
    if uses_cuda(config):
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but no CUDA device is available; use device='cpu'")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def pick_kv_cache_dtype(config: Config, model_dtype: torch.dtype) -> torch.dtype:
    """"auto": the model's dtype; "fp8" / "fp8_e4m3": e4m3 with per-layer K and V scales."""
    return model_dtype if config.kv_cache_dtype == "auto" else torch.float8_e4m3fn


def pick_dtype(config: Config, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return _DTYPES[config.dtype]
    if device.type == "cpu":
        return torch.float32
    hf = config.hf_config
    dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or torch.float32
    dtype = _DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if dtype not in _DTYPES.values():
        raise ValueError(f"the model's config.json gives dtype {dtype}, which nanovllm does not run "
                         "(quantized checkpoints are not supported); pass dtype= one of "
                         f"{', '.join(_DTYPES)}")
    return dtype


@contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
