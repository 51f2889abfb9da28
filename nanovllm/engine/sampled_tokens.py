"""The sampler's output on its way to the host (PendingSample), and there as lists (SampledTokens)."""
from dataclasses import dataclass

import torch

from nanovllm.engine.sequence import TokenLogprobs
from nanovllm.layers.sampler import SamplerOutput, SamplingTensors


@dataclass
class SampledTokens:
    """What a step gives the host, in the order of the sequences that sampled."""
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None   # None when no sequence asked


class PendingSample:
    """A launched step's sampler output on its way to the host: the device-to-host copies are
    queued right behind the sampler (into pinned memory), so waiting for them does not wait for
    work queued later, such as the next step."""

    def __init__(self, out: SamplerOutput | None, sampling: SamplingTensors | None):
        self.num_logprobs = sampling.num_logprobs if sampling is not None else None
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

    def ready(self) -> bool:
        """Have the tokens reached the host? (Polled under tensor parallelism: TPWorkers.wait_until.)"""
        return self.event is None or self.event.query()

    def result(self) -> SampledTokens:
        if self.host is None:
            return SampledTokens([])
        if self.event is not None:
            self.event.synchronize()
        token_ids = self.host[0].tolist()
        if len(self.host) == 1:
            return SampledTokens(token_ids)
        # Then per-row trimming to each request's k.
        logprob, rank, top_lp, top_ids = (t.tolist() for t in self.host[1:])
        rows = [None if k is None else TokenLogprobs(logprob[i], rank[i], top_ids[i][:k], top_lp[i][:k])
                for i, k in enumerate(self.num_logprobs)]
        return SampledTokens(token_ids, rows)
