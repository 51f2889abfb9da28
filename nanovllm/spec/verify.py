"""Verification of draft tokens against the target model: one step computes, for a sequence with k
drafts, k + 1 rows of logits (row j: the distribution of the token after draft j - 1). Greedy
accepts drafts while each is the row's argmax, then takes the argmax of the first row that
disagrees (or of the last row): exactly the tokens decoding without speculation gives. Sampling uses
rejection sampling with a one-hot draft distribution (the n-gram draft is deterministic): draft d
is accepted with probability p(d); on rejection the token is drawn from p with d removed and
renormalised; after k acceptances one more token is drawn from the last row. Each token is then
distributed exactly as the target model's p, so speculation changes speed, not outputs' law."""
from dataclasses import dataclass
from itertools import accumulate

import torch

from nanovllm.engine.sampled_tokens import PendingSample, SampledTokens, logprob_rows
from nanovllm.engine.sampling_prep import SamplingPrep, step_seed
from nanovllm.engine.sequence import Sequence, TokenLogprobs
from nanovllm.layers.sampler import Sampler, apply_min_p, apply_token_constraints, apply_top_k_top_p


@dataclass
class Verified:
    """Per sequence, in batch order: its new tokens (accepted drafts, then one more), and their
    logprobs (None where the sequence did not ask; all None when no sequence asked)."""
    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs | None]] | None


def sample_verify_step(logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]], sampler: Sampler,
                       prep: SamplingPrep) -> SampledTokens:
    """A verify step's tokens: its sequences without drafts (one row each) sampled as usual, those
    with drafts (1 + k rows each) verified. logits: [sum(len(d) + 1 for d in drafts), vocab] in
    sequence order. Every sequence gets a list of its new tokens (and of their logprobs)."""
    ends = list(accumulate(len(d) + 1 for d in drafts))
    plain = [i for i, d in enumerate(drafts) if not d]
    spec = [i for i, d in enumerate(drafts) if d]
    tokens: list[list[int]] = [[] for _ in seqs]
    logprobs: list[list] = [[None] for _ in seqs]
    asked = False
    if plain:
        sampling = prep.prepare([seqs[i] for i in plain])
        rows = torch.tensor([ends[i] - 1 for i in plain], device=logits.device)
        sampled = PendingSample(sampler.sample(logits[rows], sampling), sampling).result()
        for j, i in enumerate(plain):
            tokens[i] = [sampled.token_ids[j]]
            if sampled.logprobs is not None:
                logprobs[i], asked = [sampled.logprobs[j]], True
    if spec:
        rows = torch.tensor([r for i in spec for r in range(ends[i] - len(drafts[i]) - 1, ends[i])],
                            device=logits.device)
        verified = verify(logits[rows], [seqs[i] for i in spec], [drafts[i] for i in spec], prep)
        for j, i in enumerate(spec):
            tokens[i] = verified.token_ids[j]
            if verified.logprobs is not None:
                logprobs[i], asked = verified.logprobs[j], True
    return SampledTokens(tokens, logprobs if asked else None)


def verify(logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]],
           prep: SamplingPrep) -> Verified:
    """logits: [sum(len(d) + 1 for d in drafts), vocab], each sequence's k + 1 rows in order.
    The sequences must pass ngram.can_speculate (no penalties, grammar or bans that change per row)."""
    row_seqs = [seq for seq, d in zip(seqs, drafts) for _ in range(len(d) + 1)]
    params = prep.prepare(row_seqs)   # per row: temperature, truncation, logit_bias/allowed, logprobs
    raw = logits.float()
    logits = apply_token_constraints(raw.clone(), params) if params is not None else raw
    argmax = logits.argmax(dim=-1).tolist()
    probs = target_probs(logits, params)   # None: every row greedy
    tokens, first = [], 0
    for seq, draft in zip(seqs, drafts):
        rows = range(first, first + len(draft) + 1)
        if seq.sampling_params.greedy or probs is None:
            tokens.append(accept_greedy(draft, [argmax[r] for r in rows]))
        else:
            tokens.append(accept_sampled(draft, probs[first:first + len(draft) + 1], seq))
        first += len(draft) + 1
    return Verified(tokens, verified_logprobs(raw_logprobs(raw, params), tokens, drafts, params))


def target_probs(logits: torch.Tensor, params) -> torch.Tensor | None:
    """The target model's sampling distribution per row ([rows, vocab] fp32), as the sampler draws
    from it: temperature, then min-p, top-k and top-p truncation."""
    if params is None or params.all_greedy:
        return None
    temps = params.temperatures
    scaled = logits / torch.where(temps > 0, temps, 1.0).unsqueeze(1)
    scaled = apply_top_k_top_p(apply_min_p(scaled, params.min_p), params.top_k, params.top_p)
    return torch.softmax(scaled, dim=-1)


def accept_greedy(draft: list[int], argmax: list[int]) -> list[int]:
    """argmax: the k + 1 rows' argmax. The accepted drafts, then the first disagreeing row's argmax."""
    out = []
    for d, best in zip(draft, argmax):
        if d != best:
            return out + [best]
        out.append(d)
    return out + [argmax[len(draft)]]


def accept_sampled(draft: list[int], probs: torch.Tensor, seq: Sequence) -> list[int]:
    """probs: [k + 1, vocab], the sequence's rows. A seeded request draws token j's randomness from
    its own generator, seeded by (seed, completion, output position) as the sampler does."""
    index = torch.tensor(draft, dtype=torch.int64, device=probs.device)
    p_draft = probs[torch.arange(len(draft), device=probs.device), index].tolist()
    out = []
    for j, d in enumerate(draft):
        gen = _generator(seq, j, probs.device)
        if torch.rand((), generator=gen, device=probs.device).item() < p_draft[j]:
            out.append(d)
            continue
        residual = probs[j].clone()
        residual[d] = 0.0   # rejected: p without d, renormalised (p(d) < 1, so some mass is left)
        return out + [torch.multinomial(residual, 1, generator=gen).item()]
    bonus = torch.multinomial(probs[len(draft)], 1, generator=_generator(seq, len(draft), probs.device))
    return out + [bonus.item()]


def _generator(seq: Sequence, j: int, device: torch.device) -> torch.Generator | None:
    seed = seq.sampling_params.seed
    if seed is None:
        return None   # torch's default generator, as the sampler's unseeded rows
    step = step_seed(seed, seq.index, seq.output_index + j) & (2**63 - 1)
    return torch.Generator(device=device).manual_seed(step)


def raw_logprobs(logits: torch.Tensor, params) -> torch.Tensor | None:
    """The log-softmax the logprobs report, when a row asked: vLLM v1's raw model output (before
    logit_bias and temperature, as the sampler reports them)."""
    if params is None or params.max_logprobs is None:
        return None
    return torch.log_softmax(logits, dim=-1)


def verified_logprobs(raw: torch.Tensor | None, tokens: list[list[int]], drafts: list[list[int]],
                      params) -> list[list[TokenLogprobs | None]] | None:
    """Each new token's logprobs from its own row (rows past a sequence's last new token are dropped)."""
    if raw is None:
        return None
    rows, ids, first = [], [], 0
    for new, draft in zip(tokens, drafts):
        rows += range(first, first + len(new))
        ids += new
        first += len(draft) + 1
    index = torch.tensor(rows, dtype=torch.int64, device=raw.device)
    out = Sampler.with_logprobs(torch.tensor(ids, dtype=torch.int64, device=raw.device), raw[index],
                                params.max_logprobs)
    flat = logprob_rows(out, [params.num_logprobs[r] for r in rows])
    result, i = [], 0
    for new in tokens:
        result.append(flat[i:i + len(new)])
        i += len(new)
    return result
