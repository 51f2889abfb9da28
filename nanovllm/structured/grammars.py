"""Structured outputs on xgrammar: GrammarCompiler compiles each distinct constraint once (cached by
its spec) when a request is validated, before anything is queued, so the step loop only fills token
bitmasks; GrammarState is one sequence's matcher, advanced by the tokens appended to it."""
import json
import re
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import cache
from typing import NamedTuple

import torch

import nanovllm.envs as envs
from nanovllm.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)
CACHE_SIZE = 512   # compiled grammars kept (least recently used dropped first)


def import_xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ImportError("structured outputs need xgrammar: pip install 'nanovllm[structured]' "
                          "(or pip install xgrammar)") from None
    return xgrammar


@dataclass(frozen=True)
class GrammarVocab:
    """The token ids a grammar speaks: the tokenizer's [0, size), which may be narrower than the model's
    logits (ids past it are never allowed). xgrammar gets only these: given the model's width, it
    treats every id past the tokenizer as a special token and checks them all on each bitmask fill
    and each accepted token (SmolLM2's 49,152 tokens on Qwen3's 151,936 logits: ~100x slower).
    EOS ids past the tokenizer (a model config's) stand for one of xgrammar's stop tokens."""
    size: int
    stop_token_ids: tuple[int, ...]     # xgrammar's, all below size
    outside_stops: frozenset[int]       # EOS ids at or past size


class Grammar(NamedTuple):
    """A compiled constraint and the vocabulary it was compiled for."""
    compiled: object                    # xgrammar.CompiledGrammar
    vocab: GrammarVocab


class GrammarCompiler:
    """tokenizer: the model's Hugging Face tokenizer; vocab_size: the width of the model's logits
    (it may exceed the tokenizer's: the extra ids are never allowed); stop_token_ids: the tokens that
    end a finished grammar (the engine's EOS ids)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int]):
        xgr = import_xgrammar()
        fill_threads()   # a bad NANOVLLM_GRAMMAR_THREADS: an error for the first request, not in a step
        size = min(vocab_size, max(tokenizer.get_vocab().values()) + 1)
        inside = sorted(t for t in stop_token_ids if t < size)
        # No EOS inside the tokenizer: xgrammar finds the tokenizer's own.
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=size, stop_token_ids=inside or None)
        self.vocab = GrammarVocab(size, tuple(info.stop_token_ids),
                                  frozenset(t for t in stop_token_ids if t >= size))
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)   # the cache is ours, by spec
        self._cache: OrderedDict[tuple, Grammar] = OrderedDict()
        self._lock = threading.Lock()   # compile may be called from several threads (a server)

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """The compiled grammar of params (cached by params.key()); ValueError if it is invalid."""
        key = params.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            compiled = Grammar(self._compile(params), self.vocab)   # outside the lock: another spec
                                                                   # need not wait
        except (RuntimeError, ValueError, TypeError) as e:   # xgrammar: a bad schema, regex, grammar
            raise ValueError(f"invalid structured_outputs.{params.kind}: {str(e).strip()}") from None
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, params: StructuredOutputsParams):
        c, kind = self._compiler, params.kind
        if kind == "json":
            return c.compile_json_schema(json.dumps(params.json),
                                         any_whitespace=not params.disable_any_whitespace)
        if kind == "json_object":
            return c.compile_builtin_json_grammar()
        if kind == "regex":
            return c.compile_regex(params.regex)
        if kind == "choice":
            return c.compile_grammar(choice_grammar(params.choice))
        if kind == "grammar":
            if _looks_like_lark(params.grammar):
                raise ValueError("the grammar looks like Lark (`rule: ...`); xgrammar here takes EBNF "
                                 '(GBNF): `start: "yes" | "no"` is written `root ::= "yes" | "no"`')
            return c.compile_grammar(params.grammar)
        return c.compile_structural_tag(params.structural_tag)


def _looks_like_lark(grammar: str) -> bool:
    """Lark's rules are `name: ...` (`?name: ...` inlined); EBNF's are `name ::= ...`."""
    return "::=" not in grammar and re.search(r"^\s*\??[A-Za-z_]\w*\s*:", grammar, re.M) is not None


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are the choices (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarState:
    """One sequence's place in its grammar. It follows the sequence's accepted output tokens and
    nothing else, so a preempted and recomputed sequence resumes exactly where it was."""

    def __init__(self, grammar: Grammar):
        self.matcher = import_xgrammar().GrammarMatcher(grammar.compiled)
        self.vocab = grammar.vocab
        self.rejected = False   # a token the grammar did not allow was appended (see StopChecker)

    def accept(self, token_id: int):
        if token_id in self.vocab.outside_stops:
            token_id = self.vocab.stop_token_ids[0]
        if self.rejected:
            return
        if token_id >= self.vocab.size or not self.matcher.accept_token(token_id):
            logger.warning("token %d is not allowed by the sequence's grammar; the sequence ends", token_id)
            self.rejected = True

    @property
    def is_terminated(self) -> bool:
        """Did the grammar finish and accept a stop token (EOS)?"""
        return self.matcher.is_terminated()


@cache
def _batch_matcher(threads: int):
    # Fills many rows, on several threads (xgrammar's own pool) when threads > 1.
    return import_xgrammar().BatchGrammarMatcher(threads)


def fill_threads() -> int:
    """Threads for the bitmask fill: NANOVLLM_GRAMMAR_THREADS, default 1. One is fastest for the usual
    grammars: on the H200's 16-core host, 256 rows of a JSON schema filled in 0.45 ms a step on one
    thread and 4.8 ms on 15 (waking and joining the pool costs more than the rows; torch's CPU threads
    compete for the cores). Grammars that cost much more per row (a long counted repetition) fill
    faster on several: 11.4 ms on one thread, 2.5 ms on 15."""
    return min(envs.GRAMMAR_THREADS.get(), len(os.sched_getaffinity(0)))


def fill_bitmask(bitmask: torch.Tensor, rows: list[int], grammars: list[GrammarState]):
    """Write each grammar's allowed next tokens into its row of bitmask ([n, ceil(vocab.size / 32)]
    int32 on the host; bit j of word w allows token 32 * w + j); other rows are left as they are."""
    _batch_matcher(fill_threads()).batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask, rows)


def widen_bitmask(bitmask: torch.Tensor, constrained: torch.Tensor, vocab: GrammarVocab,
                  model_vocab_size: int) -> torch.Tensor:
    """The tokenizer-wide bitmask ([n, ceil(vocab.size / 32)] int32) as wide as the model's logits
    ([n, ceil(model_vocab_size / 32)]): in the constrained rows ([n] bool, on the bitmask's device)
    ids past the tokenizer are forbidden, but an EOS id past it is allowed wherever the grammar
    allows its own stop token. Other rows stay all ones."""
    if vocab.size == model_vocab_size:
        return bitmask
    n, width = bitmask.shape
    free = torch.where(constrained, 0, -1).to(torch.int32)                       # [n]
    out = torch.cat([bitmask, free.unsqueeze(1).expand(n, -(-model_vocab_size // 32) - width)], dim=1)
    if vocab.size % 32:   # the tokenizer's last word: only its first vocab.size % 32 bits are ids
        last = out[:, width - 1]
        out[:, width - 1] = torch.where(constrained, last & ((1 << (vocab.size % 32)) - 1), last)
    if vocab.outside_stops:
        may_stop = torch.zeros(n, dtype=torch.int32, device=bitmask.device)
        for t in vocab.stop_token_ids:
            may_stop |= (out[:, t // 32] >> (t % 32)) & 1
        for t in vocab.outside_stops:
            out[:, t // 32] |= may_stop << (t % 32)
    return out
