"""Sampling on the host side: one step's sequences and their SamplingParams become the sampler's
tensors on the device (SamplingTensors); the sampler (layers/sampler.py) then works on tensors alone.
Runs while the device computes the step's forward pass (see ModelRunner.launch)."""
import random

import torch
import xxhash

from nanovllm.engine.sequence import Sequence
from nanovllm.engine.token_constraints import banned_by_bad_words
from nanovllm.layers.sampler import SamplingTensors


class SamplingPrep:
    """Owns the host RNG that seeds the fused kernel's unseeded rows. fused: may the fused kernel
    run (default: on CUDA)? Tests set it to build the fused path's tensors on CPU (the CPU sample
    still takes the torch path)."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu", seed: int = 0,
                 fused: bool | None = None):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.fused = self.device.type == "cuda" if fused is None else fused
        # Draws the fused path's seeds of unseeded rows on the host (no device sync); seeded from
        # the engine's config seed, so a run repeats with the same config.
        self._rng = random.Random(seed)

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
        # A grammar's mask needs the sequence's previous token: RunAhead applies it first.
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


def step_seed(seed: int, index: int, step: int) -> int:
    """The seed of a seeded request's draw for its `step`-th output token of completion `index`.
    A pure function of these three, so a seeded completion's tokens depend on nothing else (not
    the batch, not preemption), and the n completions of one request differ."""
    return xxhash.xxh64_intdigest(f"{seed}/{index}/{step}".encode())


def bad_word_bans(seqs: list[Sequence]) -> list[tuple[int, int]]:
    """(row, token) pairs that would complete one of the row's bad words now."""
    return [(row, t) for row, seq in enumerate(seqs) if seq.bad_words_ids
            for t in banned_by_bad_words(seq.bad_words_ids, seq.completion_token_ids)]
