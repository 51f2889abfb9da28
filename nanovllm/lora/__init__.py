"""LoRA adapters served beside the base model: requests (request.py), PEFT folders read and
sharded (adapter.py), the per-layer slot buffers and their batched apply (layers.py), and the GPU
slots with their LRU (slots.py)."""
from nanovllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
