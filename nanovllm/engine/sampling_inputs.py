"""Turns the sampling parameters of one step's sequences into the sampler's SamplingTensors, and
the sampler's output into host lists (SampledTokens)."""
import random
from dataclasses import dataclass

import torch
import xxhash

from nanovllm.engine.sequence import Sequence, TokenLogprobs
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


def step_seed(seed: int, index: int, step: int) -> int:
    """The seed of a seeded request's draw for its `step`-th output token of completion `index`.
    A pure function of these three, so a seeded completion's tokens depend on nothing else (not
    the batch, not preemption), and the n completions of one request differ."""
    return xxhash.xxh64_intdigest(f"{seed}/{index}/{step}".encode())


def build_sampling_tensors(seqs: list[Sequence], to_tensor, vocab_size: int,
                           rng: random.Random | None = None) -> SamplingTensors | None:
    """seqs: the sequences that sample this step, in row order; to_tensor(list, dtype) puts a list
    on the runner's device. None when the batch is plain greedy (the sampler takes the argmax).
    rng: given where the fused sampling kernel can run (CUDA); it draws the seeds of unseeded rows."""
    params = [seq.sampling_params for seq in seqs]
    banned = [(row, t) for row, seq in enumerate(seqs)
              if seq.output_index < seq.sampling_params.min_tokens for t in seq.min_tokens_banned]
    asked = [p.logprobs for p in params if p.logprobs is not None]
    penalized = any(p.has_penalties for p in params)
    all_greedy = all(p.greedy for p in params)
    if all_greedy and not banned and not asked and not penalized:
        return None

    def column(values, dtype=torch.float32, used=True):
        return to_tensor(values, dtype) if used else None

    t = SamplingTensors(
        temperatures=column([0.0 if p.greedy else p.temperature for p in params]),
        all_greedy=all_greedy,
        max_logprobs=max(asked) if asked else None,
        num_logprobs=[p.logprobs for p in params] if asked else None)
    if not all_greedy:
        t.top_k = column([p.top_k if p.top_k > 0 else vocab_size for p in params], torch.int64,
                         any(p.top_k > 0 for p in params))
        t.top_p = column([p.top_p for p in params], used=any(p.top_p < 1 for p in params))
        t.min_p = column([p.min_p for p in params], used=any(p.min_p > 0 for p in params))
        t.seeds = [(row, step_seed(p.seed, seq.index, seq.output_index))
                   for row, (seq, p) in enumerate(zip(seqs, params)) if p.seed is not None and not p.greedy] or None
        only_temperature = t.top_k is None and t.top_p is None and t.min_p is None
        if rng is not None and only_temperature and not penalized and not banned and not asked:
            t.row_seeds = to_tensor(_row_seeds(params, t.seeds, rng), torch.int64)
    if penalized:
        t.output_tokens = _padded([seq.completion_token_ids if p.has_penalties else [] for seq, p in zip(seqs, params)],
                                  vocab_size, to_tensor)
        t.presence = column([p.presence_penalty for p in params], used=any(p.presence_penalty for p in params))
        t.frequency = column([p.frequency_penalty for p in params], used=any(p.frequency_penalty for p in params))
        if any(p.repetition_penalty != 1 for p in params):
            t.repetition = column([p.repetition_penalty for p in params])
            t.prompt_tokens = _padded([seq.prompt_token_ids if p.repetition_penalty != 1 else []
                                       for seq, p in zip(seqs, params)], vocab_size, to_tensor)
    if banned:
        rows, tokens = zip(*banned)
        t.banned = (to_tensor(list(rows), torch.int64), to_tensor(list(tokens), torch.int64))
    return t


def _row_seeds(params, seeds: list[tuple[int, int]] | None, rng: random.Random) -> list[int]:
    """Every row's seed for the fused kernel: the seeded rows' step seeds, fresh draws for the
    other sampling rows, 0 for greedy rows (unused). 63 bits: they travel as int64."""
    row_seeds = [0 if p.greedy else rng.getrandbits(63) for p in params]
    for row, seed in seeds or ():
        row_seeds[row] = seed & (2 ** 63 - 1)
    return row_seeds


def _padded(rows: list[list[int]], pad: int, to_tensor) -> torch.Tensor:
    # -> [len(rows), longest] int64; `pad` (>= vocab) is ignored by the sampler's token counts
    width = max(1, max(len(r) for r in rows))
    return to_tensor([r + [pad] * (width - len(r)) for r in rows], torch.int64)
