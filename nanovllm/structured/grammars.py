"""Structured outputs on xgrammar: GrammarCompiler compiles each distinct constraint once (cached by
its spec) when a request is validated, before anything is queued, so the step loop only fills token
bitmasks; GrammarState is one sequence's matcher, advanced by the tokens appended to it."""
import json
import logging
import threading
from collections import OrderedDict
from functools import cache

import torch

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


class GrammarCompiler:
    """tokenizer: the model's Hugging Face tokenizer; vocab_size: the width of the model's logits
    (it may exceed the tokenizer's: the extra ids are never allowed); stop_token_ids: the tokens that
    end a finished grammar (the engine's EOS ids)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int]):
        xgr = import_xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)   # the cache is ours, by spec
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()   # compile may be called from several threads (a server)

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of params (cached by params.key()); ValueError if it is invalid."""
        key = params.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            compiled = self._compile(params)   # outside the lock: another spec need not wait
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
            return c.compile_grammar(params.grammar)
        return c.compile_structural_tag(params.structural_tag)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are the choices (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarState:
    """One sequence's place in its grammar. It follows the sequence's accepted output tokens and
    nothing else, so a preempted and recomputed sequence resumes exactly where it was."""

    def __init__(self, compiled):
        self.matcher = import_xgrammar().GrammarMatcher(compiled)
        self.rejected = False   # a token the grammar did not allow was appended (see StopChecker)

    def accept(self, token_id: int):
        if not self.rejected and not self.matcher.accept_token(token_id):
            logger.warning("token %d is not allowed by the sequence's grammar; the sequence ends", token_id)
            self.rejected = True

    @property
    def is_terminated(self) -> bool:
        """Did the grammar finish and accept a stop token (EOS)?"""
        return self.matcher.is_terminated()


@cache
def _batch_matcher():
    # Fills many rows on several threads (xgrammar's own pool).
    return import_xgrammar().BatchGrammarMatcher()


def fill_bitmask(bitmask: torch.Tensor, rows: list[int], grammars: list[GrammarState]):
    """Write each grammar's allowed next tokens into its row of bitmask ([n, ceil(vocab / 32)] int32
    on the host; bit j of word w allows token 32 * w + j); other rows are left as they are."""
    _batch_matcher().batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask, rows)
