"""The sampler, tensors in and tokens out: one step's sampling parameters as tensors on the device
(SamplingTensors, built on the host by engine/sampling_prep.py), then penalties, temperature, min-p /
top-k / top-p truncation and the draw as batch-wide tensor operations (sample); optional logprobs of
the raw model output (vLLM v1's default logprobs_mode). A CUDA step that needs nothing but
temperature takes the fused Triton kernel (kernels/sampling.py). Structured outputs add a token
bitmask per step that both paths apply first, so a token it forbids is never sampled."""
from dataclasses import dataclass

import torch


@dataclass
class SamplingTensors:
    """One step's sampling parameters, one row per sequence that samples (built by SamplingPrep.prepare).
    A knob no row uses is None, so its work is skipped."""
    temperatures: torch.Tensor                  # [n] fp32; 0 for greedy rows
    all_greedy: bool                            # no row draws: argmax after penalties
    top_k: torch.Tensor | None = None           # [n] int64; vocab size where off
    top_p: torch.Tensor | None = None           # [n] fp32; 1 where off
    min_p: torch.Tensor | None = None           # [n] fp32; 0 where off
    presence: torch.Tensor | None = None        # [n] fp32 } with output_tokens
    frequency: torch.Tensor | None = None       # [n] fp32 }
    repetition: torch.Tensor | None = None      # [n] fp32; with output_tokens and prompt_tokens
    output_tokens: torch.Tensor | None = None   # [n, max_out] int64, padded with ids >= vocab
    prompt_tokens: torch.Tensor | None = None   # [n, max_prompt] int64, padded with ids >= vocab
    banned: tuple[torch.Tensor, torch.Tensor] | None = None   # (rows, token ids) to forbid (min_tokens,
                                                              # bad_words)
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None   # (rows, token ids, fp32 bias)
    allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # allowed_token_ids: ([n] bool, the row is limited; rows; token ids it may sample)
    seeds: list[tuple[int, int]] | None = None  # (row, seed of this step) for seeded rows
    row_seeds: torch.Tensor | None = None       # [n] int64, every row's seed of this step; set
                                                # only when temperature is the only knob (fused path)
    max_logprobs: int | None = None             # top-k width of the logprobs; None: no row asked
    num_logprobs: list[int | None] | None = None   # host: each row's `logprobs` (None: not asked)
    bitmask: torch.Tensor | None = None         # [n, ceil(vocab / 32)] int32: bit j of word w allows
                                                # token 32w + j; all ones in rows without a grammar


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                     # [n] int64
    sampled_logprobs: torch.Tensor | None = None   # [n] fp32, of the sampled token
    ranks: torch.Tensor | None = None           # [n] int64, 1 = most likely
    top_logprobs: torch.Tensor | None = None    # [n, k] fp32, descending
    top_ids: torch.Tensor | None = None         # [n, k] int64


class Sampler:
    """Owns the device's sampling state: the generators of seeded rows (each reseeded per row)."""

    def __init__(self):
        self._generators: dict[torch.device, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, params: SamplingTensors | None) -> SamplerOutput:
        # logits: [n, vocab] in the model's dtype -> SamplerOutput; params None: plain greedy batch
        if params is None:
            return SamplerOutput(logits.argmax(dim=-1))   # exact in bf16 too
        if params.row_seeds is not None and logits.is_cuda:
            from nanovllm.kernels.sampling import gumbel_max_sample   # triton: imported on CUDA only
            return SamplerOutput(gumbel_max_sample(logits, params.temperatures, params.row_seeds,
                                                   bitmask=params.bitmask))
        logits = logits.float()
        # vLLM v1 reports logprobs of the raw model output, before penalties and temperature.
        raw_logprobs = torch.log_softmax(logits, dim=-1) if params.max_logprobs is not None else None
        logits = apply_penalties(
            apply_token_constraints(apply_bitmask(logits.clone(), params.bitmask), params), params)
        if params.all_greedy:
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = self.draw(logits, params)
        return self.with_logprobs(token_ids, raw_logprobs, params.max_logprobs)

    def draw(self, logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        temps = params.temperatures
        logits = logits / torch.where(temps > 0, temps, 1.0).unsqueeze(1)
        logits = apply_min_p(logits, params.min_p)
        logits = apply_top_k_top_p(logits, params.top_k, params.top_p)
        probs = torch.softmax(logits, dim=-1)
        # Exponential race: argmax(p / E), E ~ Exp(1), picks a token with probability p, no host sync.
        noise = torch.empty_like(probs).exponential_()
        for row, seed in params.seeds or ():
            # A seeded row draws its own noise, so its token ignores the rest of the batch.
            noise[row].exponential_(generator=self._generator(probs.device).manual_seed(seed))
        sampled = probs.div_(noise.clamp_min_(1e-20)).argmax(dim=-1)
        return torch.where(temps > 0, sampled, greedy)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]

    @staticmethod
    def with_logprobs(token_ids, raw_logprobs, k) -> SamplerOutput:
        if raw_logprobs is None:
            return SamplerOutput(token_ids)
        sampled = raw_logprobs.gather(1, token_ids.unsqueeze(1))           # [n, 1]
        ranks = (raw_logprobs > sampled).sum(dim=-1) + 1
        top_logprobs, top_ids = raw_logprobs.topk(min(k, raw_logprobs.size(1)), dim=-1)
        return SamplerOutput(token_ids, sampled.squeeze(1), ranks, top_logprobs, top_ids)


def apply_token_constraints(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """vLLM's logits processors that run before the penalties, in place: logit_bias added; tokens
    outside a row's allowed_token_ids, and banned tokens (min_tokens, bad_words), set to -inf."""
    if params.logit_bias is not None:
        rows, tokens, bias = params.logit_bias
        logits.index_put_((rows, tokens), bias, accumulate=True)
    if params.allowed is not None:
        limited, rows, tokens = params.allowed
        blocked = limited.unsqueeze(1).expand_as(logits).clone()   # [n, vocab]
        blocked[rows, tokens] = False
        logits.masked_fill_(blocked, float("-inf"))
    if params.banned is not None:
        logits[params.banned] = float("-inf")
    return logits


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor | None) -> torch.Tensor:
    """-inf, in place, on every token the bitmask does not allow (also ids past the tokenizer's)."""
    if bitmask is None:
        return logits
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(1)[:, :logits.size(1)]   # [n, vocab]
    return logits.masked_fill_(allowed == 0, float("-inf"))


def apply_penalties(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """vLLM's formulas, in place. Repetition (over prompt + output tokens): positive logits are
    divided by the penalty, negative ones multiplied. Frequency and presence (over output tokens):
    logit -= count * frequency + (count > 0) * presence."""
    if params.output_tokens is None:
        return logits
    counts = token_counts(params.output_tokens, logits.size(1))        # [n, vocab]
    if params.repetition is not None:
        seen = (counts > 0) | (token_counts(params.prompt_tokens, logits.size(1)) > 0)
        penalty = params.repetition.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if params.frequency is not None:
        logits -= params.frequency.unsqueeze(1) * counts
    if params.presence is not None:
        logits -= params.presence.unsqueeze(1) * (counts > 0)
    return logits


def token_counts(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    # tokens: [n, length] padded with ids >= vocab -> counts: [n, vocab] fp32
    counts = torch.zeros(tokens.size(0), vocab + 1, device=tokens.device)
    counts.scatter_add_(1, tokens.clamp(max=vocab), torch.ones_like(tokens, dtype=counts.dtype))
    return counts[:, :vocab]


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    if min_p is None:
        return logits
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep the top_k most likely tokens (ties with the k-th are kept), then the smallest set of
    those whose probability sums to >= top_p. One ascending sort serves both."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1)
    vocab = logits.size(1)
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k.clamp(1, vocab)).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Dropped: the least likely tokens whose total mass stays within 1 - top_p; the most
        # likely token always stays.
        drop = cumulative <= 1 - top_p.unsqueeze(1)
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
