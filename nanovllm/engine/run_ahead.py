"""Running one step ahead (async scheduling; mini-sglang's overlap loop): step N+1 is scheduled and
launched before step N's sampled tokens reach the host, so the host's bookkeeping (scheduling,
applying tokens, stop checks, building inputs) overlaps the device's work. This module alone keeps
what is in flight and decides when the next batch may run ahead of it.

Invariant: at most one batch is in flight (launched, its tokens not applied). Each of its sequences
that samples has one pending token (Sequence.num_pending == 1: Scheduler.advance at launch,
Scheduler.complete when applied): it counts in num_tokens, so the next step computes its K/V, but
is not in token_ids. Its id is row rows[seq_id] of the sampled tokens kept on the device
(ModelRunner.sampled_tokens, on every rank), which the next decode step reads as its input: the
rows travel as ScheduledBatch.token_rows -> StepInput.token_rows -> DecodeInputs.token_rows, read
inside the CUDA graph too.

The next batch may not run ahead where the host must know the tokens first: penalties and bad_words
are built from the known tokens (can_run_ahead). A grammar's bitmask needs its sequence's newest
token: the batch in flight is then applied after the next forward pass is queued and before its
sampling is prepared (before_sampling), so the host's grammar work still overlaps the device.
With speculative decoding nothing runs ahead: drafts are proposed from a sequence's newest tokens,
and a verify step's tokens (how many, even) are known only after it (the simplest correct choice;
steps then alternate between host and device)."""
from dataclasses import dataclass

from nanovllm.engine.executor import Executor
from nanovllm.engine.output_builder import add_prompt_logprobs
from nanovllm.engine.sampled_tokens import PendingSample
from nanovllm.engine.scheduler import ScheduledBatch, Scheduler
from nanovllm.engine.sequence import Sequence


@dataclass
class InFlight:
    batch: ScheduledBatch
    pending: PendingSample    # its sampled tokens, on their way to the host
    rows: dict[int, int]      # seq_id -> row of its sampled tokens on the device


class RunAhead:
    """Launches each step's batch and applies the batch before it. enabled: async_scheduling
    (otherwise each batch is applied as soon as it is launched, and nothing stays in flight)."""

    def __init__(self, scheduler: Scheduler, executor: Executor, enabled: bool, speculative: bool = False):
        """speculative: speculative decoding is on (nothing runs ahead: see above)."""
        self.scheduler, self.executor, self.enabled = scheduler, executor, enabled and not speculative
        self.in_flight: InFlight | None = None

    def step(self) -> tuple[list[Sequence], ScheduledBatch]:
        """Schedule one batch and launch it; then apply the batch launched before it. Returns the
        sequences that finished, and the batch launched."""
        finished = []
        if self.in_flight and not self.can_run_ahead(self.in_flight.batch):
            finished += self.apply_in_flight()
        batch = self.scheduler.schedule()
        launched = None
        if batch.seqs:
            batch.token_rows = self.token_rows(batch)
            # (Cut short under TP after the workers got the step, a launch leaves the executor out of
            # step: every later call is refused.)
            before_sampling = None
            if self.in_flight and any(seq.grammar is not None for seq in batch.sampling_seqs):
                before_sampling = lambda: finished.extend(self.apply_in_flight())   # noqa: E731
            pending = self.executor.launch(batch, before_sampling)
            rows = {seq.seq_id: row for row, seq in enumerate(batch.sampling_seqs)}   # as sampled
            launched = InFlight(batch, pending, rows)
            self.scheduler.advance(batch)
        else:
            finished += batch.finished   # sequences ended while scheduling, with nothing to run
        finished += self.apply_in_flight()
        self.in_flight = launched
        if launched and not self.enabled:
            finished += self.apply_in_flight()
        return finished, batch

    def can_run_ahead(self, batch: ScheduledBatch) -> bool:
        """May the next batch be launched before this one's tokens are on the host? Not with
        penalties or bad_words: their token counts and bans are built on the host from the known
        tokens. (A grammar's bitmask may wait for the tokens until after the forward pass: see step.)"""
        return not any(seq.sampling_params.has_penalties or seq.bad_words_ids for seq in batch.sampling_seqs)

    def token_rows(self, batch: ScheduledBatch) -> list[int] | None:
        """Per sequence of a batch about to launch: the row of the batch in flight's sampled tokens
        that holds its input token, -1 where the host has it; None when the host has them all."""
        if not any(seq.num_pending for seq in batch.seqs):
            return None
        assert not batch.is_prefill and self.in_flight is not None   # a prompt is all known tokens
        rows = self.in_flight.rows
        return [rows[seq.seq_id] if seq.num_pending else -1 for seq in batch.seqs]

    def apply_in_flight(self) -> list[Sequence]:
        """Apply the batch in flight, if any; return the sequences that finished (results for
        sequences that finished meanwhile are dropped)."""
        if self.in_flight is None:
            return []
        in_flight, self.in_flight = self.in_flight, None
        return self.apply(in_flight)

    def apply(self, in_flight: InFlight) -> list[Sequence]:
        """Wait for a launched batch's tokens and apply them; return the sequences that finished."""
        sampled = self.executor.result(in_flight.pending)
        if sampled.prompt_logprobs:
            add_prompt_logprobs(in_flight.batch, sampled.prompt_logprobs)
        return self.scheduler.complete(in_flight.batch, sampled.token_ids, sampled.logprobs)

    def reset(self):
        """Forget the batch in flight (after a failure: its sequences are aborted)."""
        self.in_flight = None
