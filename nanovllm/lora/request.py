"""LoRARequest: which adapter a request runs with, by vLLM's fields (`from vllm.lora.request import
LoRARequest`). Plain data: it travels to the tensor-parallel workers in each step's inputs."""
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str       # the adapter's name (the server's model name for it)
    lora_int_id: int     # >= 1, unique per adapter: the engine keys its slots and the prefix cache by it
    lora_path: str = ""  # a PEFT folder: adapter_config.json + adapter_model.safetensors
    base_model_name: str | None = None   # vLLM's field, informational (the server's parent model)

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest: lora_name must be a non-empty string, got {self.lora_name!r}")
        if type(self.lora_int_id) is not int or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest: lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, (str, os.PathLike)) or not os.fspath(self.lora_path):
            raise ValueError(f"LoRARequest: lora_path must be the adapter's folder, got {self.lora_path!r}")
        object.__setattr__(self, "lora_path", os.path.expanduser(os.fspath(self.lora_path)))

    @property
    def adapter_id(self) -> int:   # vLLM's alias
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
