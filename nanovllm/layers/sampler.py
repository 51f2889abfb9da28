"""The sampler: one step's sampling parameters as tensors on the device (prepare), then penalties,
temperature, min-p / top-k / top-p truncation and the draw as batch-wide tensor operations (sample);
optional logprobs of the raw model output (vLLM v1's default logprobs_mode). A CUDA step that needs
nothing but temperature takes the fused Triton kernel (kernels/sampling.py). Structured outputs add
a token bitmask per step that both paths apply first, so a token it forbids is never sampled."""
import random
from dataclasses import dataclass

import torch
import xxhash

from nanovllm.engine.sequence import Sequence
from nanovllm.engine.token_constraints import banned_by_bad_words


@dataclass
class SamplingTensors:
    """One step's sampling parameters, one row per sequence that samples (built by Sampler.prepare).
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
    """Owns the sampling state: the host RNG that seeds the fused kernel's unseeded rows and the
    generators of seeded rows. fused: may the fused kernel run (default: on CUDA)? Tests set it to
    build the fused path's tensors on CPU (the CPU sample still takes the torch path)."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu", seed: int = 0,
                 fused: bool | None = None):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.fused = self.device.type == "cuda" if fused is None else fused
        # Draws the fused path's seeds of unseeded rows on the host (no device sync); seeded from
        # the engine's config seed, so a run repeats with the same config.
        self._rng = random.Random(seed)
        self._generators: dict[torch.device, torch.Generator] = {}

    # ---- host -> device ---------------------------------------------------------------------

    def prepare(self, seqs: list[Sequence]) -> SamplingTensors | None:
        """seqs: the sequences that sample this step, in row order. None when the batch is plain
        greedy (sample takes the argmax)."""
        params = [seq.sampling_params for seq in seqs]
        banned = [(row, t) for row, seq in enumerate(seqs)
                  if seq.output_index < seq.sampling_params.min_tokens for t in seq.min_tokens_banned]
        # logit_bias, allowed_token_ids, bad_words: the torch path. Checked inline (no property call):
        # this runs for every decode step.
        constrained = any(p.logit_bias or p.allowed_token_ids is not None or p.bad_words for p in params)
        if constrained:
            banned += bad_word_bans(seqs)
        vocab = self.vocab_size
        asked = [vocab if p.logprobs == -1 else p.logprobs for p in params if p.logprobs is not None]
        penalized = any(p.has_penalties for p in params)
        all_greedy = all(p.greedy for p in params)
        # A finished sequence's row (ended by the step applied just before; its token is dropped)
        # needs no mask, and its matcher may be terminated.
        grammar_rows = [(row, seq.grammar) for row, seq in enumerate(seqs)
                        if seq.grammar is not None and not seq.is_finished]
        # A grammar's mask needs the sequence's previous token (the engine applies it first).
        assert all(seqs[row].num_pending == 0 for row, _ in grammar_rows)
        if all_greedy and not banned and not asked and not penalized and not constrained and not grammar_rows:
            return None
        t = SamplingTensors(
            temperatures=self._tensor([0.0 if p.greedy else p.temperature for p in params]),
            all_greedy=all_greedy,
            max_logprobs=max(asked) if asked else None,
            num_logprobs=[None if p.logprobs is None else vocab if p.logprobs == -1 else p.logprobs
                          for p in params] if asked else None)
        if not all_greedy:
            self._prepare_draw(t, seqs, fused=not (penalized or banned or asked or constrained))
        if penalized:
            self._prepare_penalties(t, seqs)
        if banned:
            rows, tokens = zip(*banned)
            t.banned = (self._tensor(list(rows), torch.int64), self._tensor(list(tokens), torch.int64))
        if constrained:
            self._prepare_constraints(t, params)
        if grammar_rows:
            t.bitmask = self._bitmask(len(seqs), grammar_rows)
        return t

    def _prepare_constraints(self, t: SamplingTensors, params):
        """logit_bias as (rows, tokens, bias); allowed_token_ids as (limited rows, rows, tokens)."""
        bias = [(row, tok, b) for row, p in enumerate(params) for tok, b in (p.logit_bias or {}).items()]
        if bias:
            rows, tokens, values = zip(*bias)
            t.logit_bias = (self._tensor(list(rows), torch.int64), self._tensor(list(tokens), torch.int64),
                            self._tensor(list(values)))
        limited = [p.allowed_token_ids is not None for p in params]
        if any(limited):
            pairs = [(row, tok) for row, p in enumerate(params) for tok in p.allowed_token_ids or ()]
            rows, tokens = zip(*pairs)
            t.allowed = (self._tensor(limited, torch.bool), self._tensor(list(rows), torch.int64),
                         self._tensor(list(tokens), torch.int64))

    def _bitmask(self, n: int, grammar_rows: list) -> torch.Tensor:
        """The step's token bitmask: each constrained row's grammar fills its row (the grammar has
        seen every token of its sequence: the engine applies the previous step first)."""
        from nanovllm.structured.grammars import fill_bitmask, widen_bitmask   # xgrammar: only with a grammar
        rows, grammars = zip(*grammar_rows)
        vocab = grammars[0].vocab   # one engine, one tokenizer
        # Filled as wide as the tokenizer, and widened to the logits on the device.
        host = torch.full((n, (vocab.size + 31) // 32), -1, dtype=torch.int32,
                          pin_memory=self.device.type == "cuda")
        fill_bitmask(host, list(rows), list(grammars))
        is_row = [False] * n
        for row in rows:
            is_row[row] = True
        return widen_bitmask(host.to(self.device, non_blocking=True), self._tensor(is_row, torch.bool),
                             vocab, self.vocab_size)

    def _prepare_draw(self, t: SamplingTensors, seqs: list[Sequence], fused: bool):
        """Truncation knobs and seeds; the fused kernel's row seeds when temperature is the only knob."""
        params = [seq.sampling_params for seq in seqs]
        # top_k at or over the vocabulary keeps every token (also one too large for an int64)
        t.top_k = self._column([min(p.top_k, self.vocab_size) if p.top_k > 0 else self.vocab_size
                                for p in params], any(p.top_k > 0 for p in params), torch.int64)
        t.top_p = self._column([p.top_p for p in params], any(p.top_p < 1 for p in params))
        t.min_p = self._column([p.min_p for p in params], any(p.min_p > 0 for p in params))
        t.seeds = [(row, step_seed(p.seed, seq.index, seq.output_index))
                   for row, (seq, p) in enumerate(zip(seqs, params))
                   if p.seed is not None and not p.greedy] or None
        if self.fused and fused and t.top_k is None and t.top_p is None and t.min_p is None:
            t.row_seeds = self._tensor(self._row_seeds(params, t.seeds), torch.int64)

    def _row_seeds(self, params, seeds: list[tuple[int, int]] | None) -> list[int]:
        """Every row's seed for the fused kernel: the seeded rows' step seeds, fresh draws for the
        other sampling rows, 0 for greedy rows (unused). 63 bits: they travel as int64."""
        row_seeds = [0 if p.greedy else self._rng.getrandbits(63) for p in params]
        for row, seed in seeds or ():
            row_seeds[row] = seed & (2 ** 63 - 1)
        return row_seeds

    def _prepare_penalties(self, t: SamplingTensors, seqs: list[Sequence]):
        params = [seq.sampling_params for seq in seqs]
        t.output_tokens = self._padded([seq.completion_token_ids if p.has_penalties else []
                                        for seq, p in zip(seqs, params)])
        presence, frequency = [p.presence_penalty for p in params], [p.frequency_penalty for p in params]
        t.presence = self._column(presence, any(presence))
        t.frequency = self._column(frequency, any(frequency))
        if any(p.repetition_penalty != 1 for p in params):
            t.repetition = self._tensor([p.repetition_penalty for p in params])
            t.prompt_tokens = self._padded([seq.prompt_token_ids if p.repetition_penalty != 1 else []
                                            for seq, p in zip(seqs, params)])

    def _tensor(self, data, dtype=torch.float32) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype, pin_memory=self.device.type == "cuda")
        return t.to(self.device, non_blocking=True)

    def _column(self, values, used: bool, dtype=torch.float32) -> torch.Tensor | None:
        return self._tensor(values, dtype) if used else None

    def _padded(self, rows: list[list[int]]) -> torch.Tensor:
        # -> [len(rows), longest] int64, padded with vocab_size (ignored by token_counts)
        width = max(1, max(len(r) for r in rows))
        return self._tensor([r + [self.vocab_size] * (width - len(r)) for r in rows], torch.int64)

    # ---- on the device ----------------------------------------------------------------------

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


def step_seed(seed: int, index: int, step: int) -> int:
    """The seed of a seeded request's draw for its `step`-th output token of completion `index`.
    A pure function of these three, so a seeded completion's tokens depend on nothing else (not
    the batch, not preemption), and the n completions of one request differ."""
    return xxhash.xxh64_intdigest(f"{seed}/{index}/{step}".encode())


def bad_word_bans(seqs: list[Sequence]) -> list[tuple[int, int]]:
    """(row, token) pairs that would complete one of the row's bad words now."""
    return [(row, t) for row, seq in enumerate(seqs) if seq.bad_words_ids
            for t in banned_by_bad_words(seq.bad_words_ids, seq.completion_token_ids)]


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
