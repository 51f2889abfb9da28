"""Decode inputs packed into one int32 buffer (so a step needs a single host-to-device copy), and
the CUDA graphs that replay decode for padded batch sizes, all reading one static copy of it."""
from collections.abc import Callable
from typing import NamedTuple

import torch

from nanovllm.engine.block_manager import cdiv
from nanovllm.engine.step_input import StepInput
from nanovllm.parallel.parallel_state import wait_for_device


class DecodeInputs(NamedTuple):
    """One decode step's inputs: named views of a packed int32 buffer of `rows` sequences, the
    rows past the batch being padding. Decode computes each sequence's last token, at position
    `start` (= num_tokens - 1). The layout is the fields in this order, block_tables last, each
    [rows] field in a slot of stride(rows) entries, so that every field starts 16 bytes after the
    last: Triton compiles a kernel once for pointers aligned to 16 bytes and again for others (1.5 s
    more of a cold start when a 2-row graph's views were 8 bytes apart)."""
    input_ids: torch.Tensor      # [rows] the token computed; a placeholder 0 where token_rows is set
    positions: torch.Tensor      # [rows] its position
    slots: torch.Tensor          # [rows] the KV-cache slot its K/V go to
    context_lens: torch.Tensor   # [rows] tokens attended to, the new one included
    token_rows: torch.Tensor     # [rows] row of the previous step's sampled tokens that holds the
                                 # input token (still pending on the host); -1: it is input_ids
    order: torch.Tensor          # [rows] the rows by context length, longest first, padding last:
                                 # the order the attention kernel starts the sequences in
    lora_slots: torch.Tensor     # [rows] the sequence's LoRA adapter slot; -1: the base model
    state_slots: torch.Tensor    # [rows] the sequence's state-cache row (0, the scratch row: padding,
                                 # or a model without per-sequence state)
    block_tables: torch.Tensor   # [rows, width] the sequence's KV blocks

    @staticmethod
    def stride(rows: int) -> int:
        """The entries between two [rows] fields: rows, rounded up to 16 bytes."""
        return cdiv(rows, _ALIGN) * _ALIGN

    @staticmethod
    def numel(rows: int, width: int) -> int:
        return DecodeInputs.stride(rows) * _NUM_VECTORS + rows * width

    @staticmethod
    def pack(step: StepInput, rows: int, width: int, block_size: int, pin: bool = False) -> torch.Tensor:
        """The step's inputs laid out for `rows` rows and block tables `width` wide, in one int32
        host tensor (pinned: it can be copied to the device asynchronously)."""
        bs, starts, tables, n = block_size, step.starts, step.block_tables, step.num_seqs
        vectors = {"input_ids": [ids[0] for ids in step.token_ids],
                   "positions": starts,
                   "slots": [table[pos // bs] * bs + pos % bs for pos, table in zip(starts, tables)],
                   "context_lens": [pos + 1 for pos in starts],
                   "token_rows": step.token_rows or [-1] * n,
                   "order": longest_first(starts) + list(range(n, rows)),
                   "lora_slots": step.lora_slots or [-1] * n,
                   "state_slots": step.state_slots or [0] * n}
        pad, gap = rows - n, DecodeInputs.stride(rows) - rows
        flat = []
        for name in _VECTORS:
            flat += vectors[name]
            if name != "order":   # the order covers the padding rows already
                flat += [PADDING[name]] * pad
            flat += [0] * gap   # up to the next field's 16-byte boundary; never read
        for table in tables:
            flat += table
            flat += [PADDING["block_tables"]] * (width - len(table))
        flat += [PADDING["block_tables"]] * (pad * width)
        return torch.tensor(flat, dtype=torch.int32, pin_memory=pin)

    def fill_padding(self):
        """Make every row padding (in place)."""
        for name, view in self._asdict().items():
            if name == "order":
                view.copy_(torch.arange(view.numel(), dtype=view.dtype))
            else:
                view.fill_(PADDING[name])

    @classmethod
    def view(cls, flat: torch.Tensor, rows: int, width: int) -> "DecodeInputs":
        """The named views of a packed buffer (or of the start of a larger one)."""
        stride = cls.stride(rows)
        *slots, tables = flat[:cls.numel(rows, width)].split([stride] * _NUM_VECTORS + [rows * width])
        return cls(*(slot[:rows] for slot in slots), tables.view(rows, width))


_VECTORS = DecodeInputs._fields[:-1]   # the [rows] fields, before block_tables
_NUM_VECTORS = len(_VECTORS)
_ALIGN = 4   # int32 entries in 16 bytes
# What padding holds, per field: the kernels write no K/V for slot -1 and skip a row of length 0.
# (order is a permutation: a padding row holds its own index there.)
PADDING = {"input_ids": 0, "positions": 0, "slots": -1, "context_lens": 0, "token_rows": -1,
           "lora_slots": -1, "state_slots": 0, "block_tables": 0}


def longest_first(lengths: list[int]) -> list[int]:
    """The rows by length, longest first (ties in row order): the order the decode attention kernel
    starts the sequences in (kernels/decode_attention.py, "Launch order")."""
    return sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)


def graph_batch_sizes(max_bs: int) -> list[int]:
    """2, 4, 8, 16, 24, 32, then steps of 1/8 of the size class (40, 48, 56, 64, 80, 96, 112, 128,
    160, ...) up to max_bs: a padded batch wastes at most ~1/8 of its rows, with ~25 graphs to
    capture for 512. No graph of 1: a single sequence pads to 2 (one graph fewer to capture)."""
    sizes, b = [2, 4, 8], 16
    while b < max_bs:
        sizes.append(b)
        b += max(8, 1 << (b.bit_length() - 3))
    return sorted({s for s in sizes if s < max_bs} | {max_bs})


class DecodeGraphs:
    """Decode recorded once per batch size of graph_batch_sizes(max_bs); a batch replays the graph
    of the next size up. Every graph reads its DecodeInputs from views of one static device buffer
    (max_blocks wide block tables) and writes its hidden states to one static output buffer.
    forward(DecodeInputs) -> hidden [rows, hidden_size] is the model's decode step."""

    def __init__(self, forward: Callable[[DecodeInputs], torch.Tensor], max_bs: int, max_blocks: int,
                 block_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device, group=None):
        self.max_blocks, self.block_size = max_blocks, block_size
        self.sizes = graph_batch_sizes(max_bs)
        self.inputs = torch.zeros(DecodeInputs.numel(max_bs, max_blocks), dtype=torch.int32, device=device)
        self.outputs = torch.zeros(max_bs, hidden_size, dtype=dtype, device=device)
        self.replays: dict[int, Callable[[], None]] = {}   # batch size -> its graph's replay
        self._pool = None   # the graphs share one memory pool
        for bs in reversed(self.sizes):   # the largest first: the smaller ones fit in its pool
            self.replays[bs] = self._capture(forward, bs, group)

    def _capture(self, forward, bs: int, group) -> Callable[[], None]:
        inputs = DecodeInputs.view(self.inputs, bs, self.max_blocks)
        inputs.fill_padding()   # all rows padding: capture writes no K/V, reads no pending token

        def step():
            self.outputs[:bs] = forward(inputs)
        step()   # warm-up (and compile) outside the graph
        return self._record(step, group)

    def _record(self, step: Callable[[], None], group) -> Callable[[], None]:
        """Record step into a CUDA graph; return its replay."""
        graph = torch.cuda.CUDAGraph()
        # Watched waits (a dead peer raises): the warm-up's collectives must be done before
        # torch.cuda.graph synchronizes the device itself, which no check could interrupt.
        wait_for_device(self.inputs.device)
        with torch.cuda.graph(graph, self._pool):
            step()
        self._pool = self._pool or graph.pool()
        if group is not None:
            group.graphs.append(graph)   # reset before the group is destroyed
        wait_for_device(self.inputs.device)
        return graph.replay

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def run(self, step: StepInput) -> torch.Tensor:
        """Decode step (padded to the next captured size) by one copy of its inputs and a replay.
        Returns hidden: [num_seqs, hidden_size], a view of the static output, valid until the
        next replay (which the stream orders after this step's readers)."""
        bs = next(b for b in self.sizes if b >= step.num_seqs)
        host = DecodeInputs.pack(step, bs, self.max_blocks, self.block_size, pin=self.inputs.is_cuda)
        self.inputs[:host.numel()].copy_(host, non_blocking=True)   # the graph reads these views
        self.replays[bs]()
        return self.outputs[:step.num_seqs]
