"""The seam for layers that keep a state per sequence beside the paged KV cache (the conv and
recurrent states of linear attention): a layer declares the shape of one sequence's state
(`state_specs`), the ModelRunner allocates every layer's tensors (engine/state_cache.py) and binds
them to `states`, and in a step the layer reads and writes the rows of its sequences' slots, which
the forward context carries (Context.state_slots). The scheduler hands slots out
(engine/state_slots.py)."""
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class StateSpec:
    shape: tuple[int, ...]   # one sequence's state, on this tensor-parallel rank
    dtype: torch.dtype


class SequenceStateLayer(nn.Module):
    """A layer with per-sequence state. `states[name]`: [num_slots + 1, *spec.shape], bound by the
    ModelRunner; row 0 is scratch (CUDA-graph padding rows write there), sequences own rows 1..
    Unbound (empty) during the warm-up run: the layer then starts every sequence from zeros."""

    def __init__(self):
        super().__init__()
        self.states: dict[str, torch.Tensor] = {}

    def state_specs(self, dtype: torch.dtype) -> dict[str, StateSpec]:
        """One sequence's state tensors (name -> spec) for a model of this dtype."""
        raise NotImplementedError


def state_layers(model: nn.Module) -> list[SequenceStateLayer]:
    return [m for m in model.modules() if isinstance(m, SequenceStateLayer)]
