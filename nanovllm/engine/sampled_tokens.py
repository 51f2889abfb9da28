"""The sampler's output on its way to the host (PendingSample), and there as lists (SampledTokens)."""
from dataclasses import dataclass

import torch

from nanovllm.engine.sequence import TokenLogprobs
from nanovllm.layers.pooler import PendingPooled, start_pooled
from nanovllm.layers.sampler import Sampler, SamplerOutput, SamplingTensors


@dataclass
class SampledTokens:
    """What a step gives the host, in the order of the sequences that sampled."""
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None   # None when no sequence asked
    # seq_id -> (first prompt position, logprobs of the prompt tokens after it, one per position)
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprobs]]] | None = None


class PendingSample:
    """A launched step's sampler output on its way to the host: the device-to-host copies are
    queued right behind the sampler (into pinned memory), so waiting for them does not wait for
    work queued later, such as the next step."""

    def __init__(self, out: SamplerOutput | None, sampling: SamplingTensors | None,
                 prompt_logprobs: "PendingPromptLogprobs | None" = None, pooled: PendingPooled | None = None):
        self.num_logprobs = sampling.num_logprobs if sampling is not None else None
        self.prompt_logprobs = prompt_logprobs
        self.known: SampledTokens | None = None   # a result already on the host (see known_result)
        self.pooled = pooled   # a prompt-only step's finished outputs (layers/pooler.py)
        self.host, self.event = None, None
        if out is None:
            return
        tensors = [out.token_ids]
        if out.sampled_logprobs is not None:
            tensors += [out.sampled_logprobs, out.ranks, out.top_logprobs, out.top_ids]
        self.host = [t.to("cpu", non_blocking=True) for t in tensors]
        if out.token_ids.is_cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    @classmethod
    def pooling(cls, batch, shares: list) -> "PendingSample":
        """A prompt-only step's: nothing sampled; its shares of the pooled outputs (layers/pooler.py)."""
        return cls(None, None, pooled=start_pooled(batch, shares))

    @classmethod
    def known_result(cls, sampled: SampledTokens) -> "PendingSample":
        """A step whose tokens the host already has (a verify step: speculative decoding)."""
        pending = cls(None, None)
        pending.known = sampled
        return pending

    def ready(self) -> bool:
        """Have the tokens reached the host? (Polled under tensor parallelism: TPWorkers.wait_until.)"""
        return (self.event is None or self.event.query()) and (self.pooled is None or self.pooled.ready())

    def result(self) -> SampledTokens:
        sampled = self._sampled()
        if self.prompt_logprobs is not None:
            sampled.prompt_logprobs = self.prompt_logprobs.result()
        if self.pooled is not None:
            self.pooled.finish()
        return sampled

    def _sampled(self) -> SampledTokens:
        if self.known is not None:
            return self.known
        if self.host is None:
            return SampledTokens([])
        if self.event is not None:
            self.event.synchronize()
        token_ids = self.host[0].tolist()
        if len(self.host) == 1:
            return SampledTokens(token_ids)
        return SampledTokens(token_ids, _trimmed_rows(self.host[1:], self.num_logprobs))


def _trimmed_rows(host: list[torch.Tensor], num_logprobs: list[int | None]) -> list[TokenLogprobs | None]:
    """host: a SamplerOutput's logprob tensors on the host; each row trimmed to its request's k."""
    logprob, rank, top_lp, top_ids = (t.tolist() for t in host)
    return [None if k is None else TokenLogprobs(logprob[i], rank[i], top_ids[i][:k], top_lp[i][:k])
            for i, k in enumerate(num_logprobs)]


def logprob_rows(out: SamplerOutput, num_logprobs: list[int | None]) -> list[TokenLogprobs | None]:
    """A SamplerOutput's logprobs as one TokenLogprobs per row (None where a row did not ask); syncs."""
    return _trimmed_rows([t.cpu() for t in (out.sampled_logprobs, out.ranks, out.top_logprobs, out.top_ids)],
                         num_logprobs)


class PendingPromptLogprobs:
    """Prompt logprobs of one prefill step on their way to the host (rare: only requests that ask;
    the copy is synchronous)."""

    def __init__(self, out: SamplerOutput, spans: list[tuple[int, int, int, int]]):
        self.spans = spans   # (seq_id, first position, rows, k) in row order
        self.host = [out.sampled_logprobs.cpu(), out.ranks.cpu(), out.top_logprobs.cpu(), out.top_ids.cpu()]

    def result(self) -> dict[int, tuple[int, list[TokenLogprobs]]]:
        logprob, rank, top_lp, top_ids = (t.tolist() for t in self.host)
        out, row = {}, 0
        for seq_id, first, count, k in self.spans:
            out[seq_id] = (first, [TokenLogprobs(logprob[i], rank[i], top_ids[i][:k], top_lp[i][:k])
                                   for i in range(row, row + count)])
            row += count
        return out


def prompt_logprobs(logits: torch.Tensor, batch, step) -> PendingPromptLogprobs:
    """logits: [sum of step.prompt_logprob_counts, vocab], one row per prompt position in step
    order -> the raw-model log-softmax of the prompt token each position predicts, its rank and
    the top-k (k: the largest prompt_logprobs asked; -1 is the whole vocabulary)."""
    vocab, spans, targets = logits.size(1), [], []
    for seq, start, count in zip(batch.seqs, step.starts, step.prompt_logprob_counts):
        if count:
            k = seq.sampling_params.prompt_logprobs
            spans.append((seq.seq_id, start, count, vocab if k == -1 else k))
            targets += seq.token_ids[start + 1:start + 1 + count]
    raw = torch.log_softmax(logits.float(), dim=-1)
    target_ids = torch.tensor(targets, dtype=torch.int64, device=logits.device)
    return PendingPromptLogprobs(Sampler.with_logprobs(target_ids, raw, max(s[3] for s in spans)), spans)
