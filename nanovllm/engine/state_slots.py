"""StateSlots: which sequence owns which row of the per-sequence state cache (the conv and recurrent
states of linear-attention layers, engine/state_cache.py), beside the BlockManager's KV blocks.

A sequence takes a slot when it is first given blocks and gives it back whenever it lets go of them
(finished, aborted or preempted): recompute preemption recomputes the state from position 0, as it
does the K/V. Slots are 1..num_slots; row 0 of the state tensors is the CUDA graphs' scratch row."""


class StateSlots:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.reset()

    def reset(self):
        """Every slot free, as at start-up."""
        self.free_slots = list(range(self.num_slots, 0, -1))   # pop() hands out slot 1 first

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def can_allocate(self) -> bool:
        return bool(self.free_slots)

    def allocate(self, seq):
        assert seq.state_slot is None
        seq.state_slot = self.free_slots.pop()

    def free(self, seq):
        if seq.state_slot is not None:
            assert seq.state_slot not in self.free_slots
            self.free_slots.append(seq.state_slot)
            seq.state_slot = None
