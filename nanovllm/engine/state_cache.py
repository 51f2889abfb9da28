"""The per-sequence state cache beside the paged KV cache: for each SequenceStateLayer (the
linear-attention layers), one tensor per state it declares, [num_slots + 1, *shape] (row 0 scratch,
see layers/sequence_state.py), taken from the same memory budget as the KV blocks."""
import logging
import math
from collections.abc import Callable

import torch
from torch import nn

from nanovllm.config import Config
from nanovllm.layers.sequence_state import SequenceStateLayer, state_layers
from nanovllm.parallel.parallel_state import min_across_ranks

logger = logging.getLogger(__name__)


def bytes_per_slot(layers: list[SequenceStateLayer], dtype: torch.dtype) -> int:
    return sum(spec.dtype.itemsize * math.prod(spec.shape)
               for layer in layers for spec in layer.state_specs(dtype).values())


def split_budget(budget: int, block_bytes: int, slot_bytes: int, max_num_seqs: int) -> tuple[int, int]:
    """(state slots, KV blocks) from one budget of bytes. The slots (a running sequence holds one)
    take at most half of it: max_num_seqs of them when they fit there, else as many as do (at least
    one, with a block beside it); the KV blocks get the rest."""
    fit = max(budget // 2 // slot_bytes, 1 if budget >= slot_bytes + block_bytes else 0)
    slots = min(max_num_seqs, fit)
    return slots, (budget - slots * slot_bytes) // block_bytes


def allocate_beside_kv(model: nn.Module, config: Config, dtype: torch.dtype, device: torch.device,
                       budget: Callable[[], int], block_bytes: int) -> tuple[int, "StateCache | None"]:
    """(KV blocks, the model's state cache, None when its layers keep no state). budget() gives the
    bytes for both; a fixed num_kvcache_blocks takes no budget and gets a slot per block, up to
    max_num_seqs (a running sequence holds at least one block). The slots are the same on every rank."""
    layers = state_layers(model)
    if not layers:
        return config.num_kvcache_blocks or budget() // block_bytes, None
    slot_bytes = bytes_per_slot(layers, dtype)
    if config.num_kvcache_blocks:
        blocks, slots = config.num_kvcache_blocks, min(config.max_num_seqs, config.num_kvcache_blocks)
    else:
        slots, blocks = split_budget(budget(), block_bytes, slot_bytes, config.max_num_seqs)
    slots = min_across_ranks(slots, device)
    if slots < 1:
        raise ValueError(f"no memory left for one sequence's linear-attention state ({slot_bytes} bytes) "
                         "beside a KV block: raise kv_cache_memory_bytes or gpu_memory_utilization")
    return blocks, StateCache(layers, slots, dtype, device)


class StateCache:
    def __init__(self, layers: list[SequenceStateLayer], num_slots: int, dtype: torch.dtype,
                 device: torch.device):
        self.layers, self.num_slots, self.dtype = layers, num_slots, dtype
        self.tensors: list[torch.Tensor] = []
        for layer in layers:
            layer.states = {name: torch.zeros(num_slots + 1, *spec.shape, dtype=spec.dtype, device=device)
                            for name, spec in layer.state_specs(dtype).items()}
            self.tensors.extend(layer.states.values())
        logger.info("%s", self.describe())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def describe(self) -> str:
        """For the start-up log: what one slot holds, and the whole cache."""
        each = ", ".join(f"{name} {list(s.shape)} {str(s.dtype).removeprefix('torch.')}"
                         for name, s in self.layers[0].state_specs(self.dtype).items())
        return (f"state cache: {self.num_slots} sequence slots x {len(self.layers)} linear-attention "
                f"layers ({each} each) = {self.nbytes / 2 ** 30:.2f} GiB")
