"""The forward context: per-step attention metadata the layers read, scoped to one forward pass."""
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Context:
    is_prefill: bool = False
    cu_seqlens_q: torch.Tensor | None = None   # [num_seqs + 1] int32, new tokens per sequence (prefill)
    cu_seqlens_k: torch.Tensor | None = None   # [num_seqs + 1] int32, cached + new tokens (prefill)
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    slot_mapping: torch.Tensor | None = None   # [num_tokens] int32 cache slot of each new token; -1 = skip
    context_lens: torch.Tensor | None = None   # [num_seqs] int32 tokens to attend to (decode)
    block_tables: torch.Tensor | None = None   # [num_seqs, max_blocks] int32; None in prefill: no prefix
    decode_order: torch.Tensor | None = None   # [num_seqs] int32 rows by context, longest first (decode)
    kv_slots: torch.Tensor | None = None       # [total_k] int64 slot of each key (prefill with block_tables)
    lora: object | None = None                 # kernels.lora.LoRABatch: each token's adapter slot (LoRA on)
    state_slots: torch.Tensor | None = None    # [num_seqs] int state-cache row of each sequence (a model
                                               # with per-sequence state; layers/sequence_state.py)


# Context is frozen, so one shared default is safe.
_context: ContextVar[Context] = ContextVar("nanovllm_forward_context", default=Context())  # noqa: B039


def get_context() -> Context:
    return _context.get()


@contextmanager
def forward_context(context: Context):
    token = _context.set(context)
    try:
        yield context
    finally:
        _context.reset(token)
