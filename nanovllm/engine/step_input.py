"""StepInput: what every tensor-parallel rank needs to run one model step, and no more.

Rank 0 builds it from the ScheduledBatch and sends it to the other ranks (pickled through shared
memory), so it is flat lists of ints rather than Sequence objects: a decode step carries one token
per sequence, never the whole history."""
from dataclasses import dataclass

from nanovllm.engine.scheduler import ScheduledBatch


@dataclass
class StepInput:
    is_prefill: bool
    seq_ids: list[int]
    starts: list[int]              # tokens of each sequence already in the KV cache (num_computed_tokens)
    token_ids: list[list[int]]     # tokens each sequence computes now: a prefill chunk, or [last token]
    block_tables: list[list[int]]
    samples: list[bool]            # this step reaches the sequence's end, so its logits are sampled

    @classmethod
    def of(cls, batch: ScheduledBatch) -> "StepInput":
        starts = [seq.num_computed_tokens for seq in batch.seqs]
        return cls(
            is_prefill=batch.is_prefill,
            seq_ids=[seq.seq_id for seq in batch.seqs],
            starts=starts,
            token_ids=[seq.token_ids[s:s + n] for seq, s, n in zip(batch.seqs, starts, batch.num_new_tokens)],
            block_tables=[seq.block_table for seq in batch.seqs],
            samples=batch.samples,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)
