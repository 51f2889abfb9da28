"""The GPU slots' table, kept by rank 0: which adapter is in which of the max_loras slots, least
recently used first. The scheduler admits no more distinct adapters into the running set than there
are slots (Scheduler.lora_fits), so a step's adapters always find slots; one that is not in a slot
takes a free one or evicts the least recently used adapter that the step does not use."""
from collections import OrderedDict

from nanovllm.lora.request import LoRARequest


class SlotTable:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.slot_of: OrderedDict[int, int] = OrderedDict()   # lora_int_id -> slot, LRU first

    def assign(self, requests: list[LoRARequest | None]) -> tuple[list[int], list[tuple[int, LoRARequest]]]:
        """Each request's slot (-1: the base model), and the (slot, adapter) loads this step needs
        first, on every rank."""
        needed = {r.lora_int_id: r for r in requests if r is not None}
        assert len(needed) <= self.num_slots, "the scheduler admitted more adapters than slots"
        loads = []
        for lora_id in needed:
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
        for lora_id, request in needed.items():
            if lora_id in self.slot_of:
                continue
            if len(self.slot_of) < self.num_slots:
                slot = len(self.slot_of)
            else:
                victim = next(i for i in self.slot_of if i not in needed)
                slot = self.slot_of.pop(victim)
            self.slot_of[lora_id] = slot
            loads.append((slot, request))
        return [-1 if r is None else self.slot_of[r.lora_int_id] for r in requests], loads

    def reset(self):
        self.slot_of.clear()
