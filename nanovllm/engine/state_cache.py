"""The per-sequence state cache beside the paged KV cache: for each SequenceStateLayer (the
linear-attention layers), one tensor per state it declares, [num_slots + 1, *shape] (row 0 scratch,
see layers/sequence_state.py), taken from the same memory budget as the KV blocks."""
import logging

import torch

from nanovllm.layers.sequence_state import SequenceStateLayer

logger = logging.getLogger(__name__)


def bytes_per_slot(layers: list[SequenceStateLayer], dtype: torch.dtype) -> int:
    return sum(spec.dtype.itemsize * _numel(spec.shape)
               for layer in layers for spec in layer.state_specs(dtype).values())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def split_budget(budget: int, block_bytes: int, slot_bytes: int, max_num_seqs: int) -> tuple[int, int]:
    """(state slots, KV blocks) from one budget of bytes. The slots (a running sequence holds one)
    take at most half of it: max_num_seqs of them when they fit there, else as many as do (at least
    one, with a block beside it); the KV blocks get the rest."""
    fit = max(budget // 2 // slot_bytes, 1 if budget >= slot_bytes + block_bytes else 0)
    slots = min(max_num_seqs, fit)
    return slots, (budget - slots * slot_bytes) // block_bytes


class StateCache:
    def __init__(self, layers: list[SequenceStateLayer], num_slots: int, dtype: torch.dtype,
                 device: torch.device):
        self.layers, self.num_slots, self.dtype = layers, num_slots, dtype
        self.tensors: list[torch.Tensor] = []
        for layer in layers:
            layer.states = {name: torch.zeros(num_slots + 1, *spec.shape, dtype=spec.dtype, device=device)
                            for name, spec in layer.state_specs(dtype).items()}
            self.tensors.extend(layer.states.values())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def describe(self) -> str:
        """For the start-up log: what one slot holds, and the whole cache."""
        specs = self.layers[0].state_specs(self.dtype)
        per_layer = ", ".join(f"{name} {list(s.shape)} {str(s.dtype).removeprefix('torch.')}"
                              for name, s in specs.items())
        return (f"state cache: {self.num_slots} sequence slots x {len(self.layers)} linear-attention layers "
                f"({per_layer} each) = {self.nbytes / 2 ** 30:.2f} GiB")

    def zero(self, slots: list[int]):
        """Start these slots' sequences from zeros (their first prefill step)."""
        if slots:
            index = torch.tensor(slots, device=self.tensors[0].device)
            for t in self.tensors:
                t.index_fill_(0, index, 0)

    def release(self):
        for layer in self.layers:
            layer.states = {}
        self.tensors = []
