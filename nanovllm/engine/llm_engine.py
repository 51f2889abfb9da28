"""The engine: tokenizer, model runner and scheduler; add_request / step / generate."""
import functools
import logging
import numbers
import threading
import weakref
from contextlib import contextmanager

from nanovllm.config import Config
from nanovllm.engine.block_manager import cdiv
from nanovllm.engine.detokenizer import decode_output
from nanovllm.engine.executor import Executor
from nanovllm.engine.generation_defaults import default_sampling_overrides
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.progress import Progress, check_use_tqdm
from nanovllm.engine.sampled_tokens import PendingSample
from nanovllm.engine.scheduler import ScheduledBatch, Scheduler
from nanovllm.engine.sequence import Sequence, TokenLogprobs
from nanovllm.engine.stop_checker import ABORT
from nanovllm.engine.token_constraints import bad_words_token_ids
from nanovllm.inputs import UNSUPPORTED_PROMPT_KEYS
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.structured.params import StructuredOutputsParams
from nanovllm.utils.hf_files import generation_eos_token_id, load_tokenizer

logger = logging.getLogger(__name__)


def eos_token_ids(config: Config, tokenizer) -> set[int]:
    """EOS ids from the model config, generation_config.json and the tokenizer, together."""
    ids = set()
    sources = [config.hf_config.eos_token_id, tokenizer.eos_token_id if tokenizer else None,
               generation_eos_token_id(config.model)]
    for src in sources:
        ids.update([src] if isinstance(src, int) else (src or []))
    return ids


def secondary_eos_token_ids(eos_ids: set[int], tokenizer) -> frozenset[int]:
    """The EOS ids vLLM treats as stop tokens (stop_reason = the id): all but the tokenizer's own
    EOS, or all of them without a tokenizer."""
    primary = tokenizer.eos_token_id if tokenizer is not None else None
    return frozenset(eos_ids - {primary})


NO_TOKENIZER = "the model folder has none, or skip_tokenizer_init=True"


def past_max_logprobs(k: int | None, cap: int) -> bool:
    """Does a request's logprobs / prompt_logprobs k (-1: the whole vocabulary) pass LLM(max_logprobs)
    (-1: no cap)?"""
    return k is not None and cap != -1 and (k == -1 or k > cap)


def check_lora_and_priority(lora_request, priority, num_prompts: int):
    """vLLM's generate options for features nanovllm does not have, taken at their defaults so
    that vLLM code passing them explicitly runs unchanged: lora_request None; priority None or
    all 0 (vLLM's default first-come-first-served policy also refuses other priorities)."""
    if lora_request is not None:
        raise ValueError("lora_request: nanovllm serves no LoRA adapters; pass None")
    if priority is not None:
        if len(priority) != num_prompts:
            raise ValueError(f"priority has {len(priority)} entries for {num_prompts} prompts")
        if any(p != 0 for p in priority):
            raise ValueError("priority: nanovllm schedules first come, first served, with no "
                             "priorities; pass None (or zeros)")


class ShutDownDuringCall(RuntimeError):
    """shutdown() ran in another thread while this call was using the engine."""


def serialised(method):
    """Run an engine method holding the engine's lock, so threads sharing one engine take turns: a
    generate call runs from queueing its first sequence to building its last output with no other
    caller's step in between, and gives exactly the tokens it would alone. Also refuses an engine
    whose tensor-parallel ranks fell out of step, and finishes a reset that a second interrupt cut
    short."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            if self.executor.out_of_step:
                raise RuntimeError(f"this engine can no longer run: {self.executor.out_of_step}. "
                                   "Create a new LLM (and shut this one down)")
            if self._dirty:
                self._reset()
            was_closed = self.executor.closed
            try:
                return method(self, *args, **kwargs)
            except ShutDownDuringCall:
                raise   # from a serialised call inside this one (chat calls generate)
            except Exception as e:
                if self.executor.closed and not was_closed:   # shutdown() from another thread released
                    raise ShutDownDuringCall(                   # what this call was using
                        "the engine was shut down (by another thread) during this call") from e
                raise
    return locked


class LLMEngine:
    def __init__(self, model: str, **options):
        self._lock = threading.RLock()   # see serialised
        self._dirty = False   # the bookkeeping may be half-updated: reset it before the next call
        # Every sequence queued and still alive, so a reset ends them all, also one that was
        # between two queues when the failure came.
        self._queued: weakref.WeakSet[Sequence] = weakref.WeakSet()
        self.config = c = Config.create(model, **options)
        self.tokenizer = (None if c.skip_tokenizer_init
                          else load_tokenizer(c.tokenizer or c.model, c.tokenizer_mode))
        self.executor = Executor(c)   # rank 0's runner here, and the workers under TP
        eos_ids = eos_token_ids(c, self.tokenizer)
        self.scheduler = Scheduler(c.max_num_seqs, c.max_num_batched_tokens, c.max_model_len,
                                   self.model_runner.num_kvcache_blocks, c.kvcache_block_size,
                                   eos_ids, c.enable_prefix_caching, self.tokenizer,
                                   secondary_eos_token_ids(eos_ids, self.tokenizer))
        # SamplingParams fields the model's generation config sets (used when none are given).
        self.default_sampling_overrides = default_sampling_overrides(c.model, c.generation_config)
        # The launched batch whose tokens have not been applied yet (see step).
        self._in_flight: tuple[ScheduledBatch, PendingSample] | None = None
        self._grammar_compiler = None   # built by the first request with structured_outputs

    @property
    def model_runner(self) -> ModelRunner:
        return self.executor.runner

    def get_tokenizer(self):
        return self.tokenizer

    @property
    def model_config(self) -> Config:
        """vLLM scripts read llm.llm_engine.model_config (max_model_len, hf_config, model, dtype)."""
        return self.config

    @serialised
    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget every cached prefix (say, after the weights changed). False, and nothing
        done, while requests are queued or running (their blocks are in use)."""
        if not self.is_finished():
            return False
        self.scheduler.block_manager.reset()
        return True

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults for this model: SamplingParams() with the sampling settings of the
        model's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty,
        max_new_tokens as max_tokens); LLM(generation_config="vllm") ignores that file."""
        return SamplingParams(**self.default_sampling_overrides)

    def shutdown(self):
        """Stop the tensor-parallel workers and their process group (also done at interpreter
        exit) and give the device memory back. Idempotent; the engine cannot generate afterwards."""
        if getattr(self, "executor", None) is not None:
            self.executor.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass   # best effort: the interpreter may be tearing down

    # ---- requests -------------------------------------------------------------------------

    def _token_ids(self, prompt, index: int, truncate: int | None = None) -> list[int]:
        """Validate one prompt and return its token ids; errors name the prompt's index. truncate:
        SamplingParams.truncate_prompt_tokens (keep the last k tokens; -1: as many as fit)."""
        where = f"prompt {index}"
        prompt = _unwrap_prompt_dict(prompt, where)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{where}: the engine has no tokenizer ({NO_TOKENIZER}), "
                                 "so prompts must be token-id lists")
            ids = encode_text(self.tokenizer, prompt, where)
        elif isinstance(prompt, (list, tuple)):
            if all(type(t) is int for t in prompt):   # the common case, checked fast (bench: 144k ids)
                ids = list(prompt)
            else:
                bad = next((i for i, t in enumerate(prompt) if not _is_token_id(t)), None)
                if bad is not None:
                    raise TypeError(f"{where}: a token-id prompt must be a flat list of ints; item {bad} is "
                                    f"{type(prompt[bad]).__name__} {prompt[bad]!r}")
                ids = [int(t) for t in prompt]   # numpy integers become plain ints
        else:
            raise TypeError(f"{where}: expected a string or a list of token ids, got {type(prompt).__name__}")
        limit = self.config.max_model_len
        if truncate is not None:
            if truncate >= limit:
                raise ValueError(f"{where}: truncate_prompt_tokens={truncate} leaves no room for output in "
                                 f"max_model_len={limit}: use at most {limit - 1}, or -1")
            ids = ids[-(limit - 1 if truncate == -1 else truncate):]
        vocab = self.config.hf_config.vocab_size
        if not ids:
            raise ValueError(f"{where} is empty"
                             + (" (its text has no tokens)" if isinstance(prompt, str) else ""))
        if min(ids) < 0 or max(ids) >= vocab:
            bad = next(i for i, t in enumerate(ids) if not 0 <= t < vocab)
            raise ValueError(f"{where}: token id {ids[bad]} at position {bad} is outside the model's "
                             f"vocabulary [0, {vocab})")
        if len(ids) >= limit:   # the prompt and at least one output token must fit
            raise ValueError(f"{where} has {len(ids)} tokens, too many for max_model_len={limit} (prompt + "
                             f"output): shorten it to at most {limit - 1} tokens or raise max_model_len")
        blocks = self.model_runner.num_kvcache_blocks
        if cdiv(len(ids), self.config.kvcache_block_size) > blocks:
            raise ValueError(f"{where} has {len(ids)} tokens and cannot fit in the whole KV cache "
                             f"({blocks} blocks of {self.config.kvcache_block_size} tokens); "
                             "give the cache more memory "
                             "(gpu_memory_utilization, kv_cache_memory_bytes or num_kvcache_blocks)")
        return ids

    @serialised
    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None, *,
                    prompt_index: int = 0) -> list[Sequence]:
        """Queue one prompt; return its sampling_params.n sequences (completions 0..n-1).
        prompt_index: the prompt's place in its caller's batch, which error messages name."""
        params = self._params_list(sampling_params, 1)[0]
        seqs = self._new_seqs(self._token_ids(prompt, prompt_index, params.truncate_prompt_tokens), params)
        with self._reset_on_error():
            self._queue(seqs)
        return seqs

    def _queue(self, seqs: list[Sequence]):
        self._queued.update(seqs)
        for seq in seqs:
            self.scheduler.add(seq)

    # ---- failures -------------------------------------------------------------------------

    @contextmanager
    def _reset_on_error(self):
        """Any exception or interrupt inside leaves the engine as a fresh one (see _reset). The
        dirty flag covers an interrupt that lands in the recovery itself: the next call resets."""
        was_dirty, self._dirty = self._dirty, True
        try:
            yield
        except BaseException:
            self._reset()
            raise
        self._dirty = was_dirty

    def _reset(self):
        """After a failure anywhere in a call or step: drop the batch in flight, end every queued
        sequence with finish_reason "abort", and rebuild the scheduler's queues and blocks from
        nothing (the prefix cache too), since an interrupt may have landed between any two
        updates of them. The model runner needs nothing: a new sequence reads no state of an old one."""
        self._dirty = True
        self._in_flight = None
        for seq in list(self._queued):
            seq.abort()
        self._queued.clear()
        self.scheduler.reset()
        self._dirty = False

    @serialised
    def abort(self, seqs: list[Sequence]):
        """Stop these sequences now (their client went away) and free their KV blocks; a token
        still in flight for one of them is dropped when it arrives."""
        with self._reset_on_error():
            for seq in seqs:
                self.scheduler.finish(seq, ABORT)

    def _check_params(self, params: SamplingParams, index: int):
        try:
            params.validate()   # again: its fields may have been changed since it was built
        except (ValueError, TypeError) as e:
            raise type(e)(f"sampling_params {index}: {e}") from None
        vocab = self.config.hf_config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"sampling_params {index}: stop_token_ids must be in [0, {vocab}) "
                             "(the model's vocabulary)")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"sampling_params {index}: stop strings need a tokenizer, and the engine "
                             f"has none ({NO_TOKENIZER}): use stop_token_ids")
        for name in ("logit_bias", "allowed_token_ids"):
            if any(t >= vocab for t in getattr(params, name) or ()):
                raise ValueError(f"sampling_params {index}: {name} token ids must be in [0, {vocab}) "
                                 "(the model's vocabulary)")
        if params.bad_words and self.tokenizer is None:
            raise ValueError(f"sampling_params {index}: bad_words need a tokenizer; the model folder has "
                             "none")
        cap = self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if past_max_logprobs(k, cap):
                raise ValueError(f"sampling_params {index}: {name}={k} is more than max_logprobs={cap}; "
                                 "ask for fewer or raise LLM(max_logprobs=...) (-1: no cap)")
        if params.structured_outputs is not None:
            try:
                self.compile_grammar(params.structured_outputs)   # compiled now, and cached
            except ValueError as e:
                raise ValueError(f"sampling_params {index}: {e}") from None

    def compile_grammar(self, params: StructuredOutputsParams):
        """The grammar of a structured_outputs, compiled once per distinct spec while requests are
        validated, so the step loop only fills token bitmasks. Thread-safe: a server may call it
        before add_request, off its engine loop, so add_request then finds it cached."""
        if self._grammar_compiler is None:
            if self.tokenizer is None:
                raise ValueError(f"structured outputs need a tokenizer, and the engine has none "
                                 f"({NO_TOKENIZER}): pass tokenizer=FOLDER")
            from nanovllm.structured.grammars import GrammarCompiler   # xgrammar: an optional extra
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.config.hf_config.vocab_size,
                                                     self.scheduler.eos_token_ids)
        return self._grammar_compiler.compile(params)

    def _new_seqs(self, token_ids: list[int], params: SamplingParams) -> list[Sequence]:
        # n sequences share the prompt (the prefix cache shares its blocks once they are computed).
        eos = frozenset(self.scheduler.eos_token_ids)
        compiled = None
        if params.structured_outputs is not None:
            from nanovllm.structured.grammars import GrammarState
            compiled = self.compile_grammar(params.structured_outputs)   # a cache hit: checked before
        seqs = [Sequence(token_ids, params, index=i, eos_token_ids=eos,
                         grammar=GrammarState(compiled) if compiled is not None else None)
                for i in range(params.n)]   # each completion its own matcher
        if params.bad_words:
            bad = bad_words_token_ids(self.tokenizer, params.bad_words)
            for seq in seqs:
                seq.bad_words_ids = bad
        return seqs

    # ---- stepping -------------------------------------------------------------------------

    @serialised
    def step(self) -> tuple[list[Sequence], ScheduledBatch]:
        """Schedule one batch and launch it; then apply the results of the batch launched before
        it. The host so does its bookkeeping while the device computes, and waits only for
        tokens of the previous batch (async_scheduling; otherwise each batch is applied at once).
        Returns the sequences that finished, and the batch launched. An exception aborts every
        queued request (see _reset)."""
        with self._reset_on_error():
            return self._step()

    def _step(self) -> tuple[list[Sequence], ScheduledBatch]:
        finished = []
        if self._in_flight and not self._can_run_ahead(self._in_flight[0]):
            finished += self._apply_in_flight()
        batch = self.scheduler.schedule()
        launched = None
        if batch.seqs:
            # A grammar's next bitmask needs the token sampled by the batch in flight: that batch is
            # applied once this one's forward pass is queued, before its sampling is prepared, so the
            # host's grammar work overlaps the forward pass. (Cut short under TP after the workers
            # got the step, a launch leaves the executor out of step: every later call is refused.)
            before_sampling = None
            if self._in_flight and any(seq.grammar is not None for seq in batch.sampling_seqs):
                before_sampling = lambda: finished.extend(self._apply_in_flight())   # noqa: E731
            launched = batch, self.executor.launch(batch, before_sampling)
            self.scheduler.advance(batch)
        else:
            finished += batch.finished   # sequences ended while scheduling, with nothing to run
        finished += self._apply_in_flight()
        self._in_flight = launched
        if launched and not self.config.async_scheduling:
            finished += self._apply_in_flight()
        return finished, batch

    def _can_run_ahead(self, batch: ScheduledBatch) -> bool:
        """May the next batch be launched before this one's tokens are on the host? Not with
        penalties or bad_words: their token counts and bans are built on the host from the known
        tokens. (A grammar's bitmask may wait for the tokens after the forward pass: see _step.
        Without async_scheduling nothing is left in flight to ask about.)"""
        return not any(seq.sampling_params.has_penalties or seq.bad_words_ids for seq in batch.sampling_seqs)

    def _apply_in_flight(self) -> list[Sequence]:
        """Apply the batch in flight, if any; return the sequences that finished."""
        if self._in_flight is None:
            return []
        in_flight, self._in_flight = self._in_flight, None
        return self._apply(*in_flight)

    def _apply(self, batch: ScheduledBatch, pending: PendingSample) -> list[Sequence]:
        """Wait for a launched batch's tokens and apply them; return the sequences that finished."""
        sampled = self.executor.result(pending)
        if sampled.prompt_logprobs:
            add_prompt_logprobs(batch, sampled.prompt_logprobs)
        return self.scheduler.complete(batch, sampled.token_ids, sampled.logprobs)

    def _drain(self):
        """Apply the batch still in flight, if any (results for finished sequences are dropped)."""
        self._apply_in_flight()

    @serialised
    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and self._in_flight is None

    @serialised
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm=True, lora_request=None, priority=None) -> list[RequestOutput]:
        """vLLM's LLM.generate: one RequestOutput per prompt, in prompt order. use_tqdm: show a
        progress bar (True), none (False), or draw it with this tqdm-like callable. lora_request,
        priority: see check_lora_and_priority. Threads may share an engine: their calls are served
        one after another (see serialised). An exception or Ctrl-C anywhere inside leaves the
        engine as a fresh one (see _reset)."""
        check_use_tqdm(use_tqdm)
        prompts = _as_prompt_list(prompts)
        check_lora_and_priority(lora_request, priority, len(prompts))
        params = self._params_list(sampling_params, len(prompts))
        # all checked before any is queued
        token_ids = [self._token_ids(p, i, sp.truncate_prompt_tokens)
                     for i, (p, sp) in enumerate(zip(prompts, params))]
        requests = [self._new_seqs(ids, sp) for ids, sp in zip(token_ids, params)]
        seqs = [seq for request in requests for seq in request]
        with self._reset_on_error():
            self._queue(seqs)
            self._run_until_done(requests, use_tqdm)
            self._drain()
            return [self._output(request, p) for request, p in zip(requests, prompts)]

    def _run_until_done(self, requests: list[list[Sequence]], use_tqdm):
        progress = Progress(use_tqdm, len(requests))
        prompt_of = {seq.seq_id: i for i, request in enumerate(requests) for seq in request}
        unfinished = [len(request) for request in requests]   # sequences left per prompt (for the bar)
        seqs = [seq for request in requests for seq in request]
        try:
            while not all(seq.is_finished for seq in seqs):
                finished, _ = self._step()   # generate holds the lock and resets on errors
                done = []   # the prompts this step finished (each its n sequences)
                for seq in finished:
                    i = prompt_of.get(seq.seq_id)
                    if i is not None:
                        unfinished[i] -= 1
                        if unfinished[i] == 0:
                            done.append(requests[i])
                if done:   # as vLLM counts them: each completion's prompt tokens, and its output tokens
                    progress.finished(len(done), sum(s.num_prompt_tokens for r in done for s in r),
                                      sum(s.num_completion_tokens for r in done for s in r))
        finally:
            summary = progress.close()
        if not self.config.disable_log_stats:
            logger.info("generate: %d prompts, %s", len(requests), summary)

    def _params_list(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(sampling_params, SamplingParams):
            self._check_params(sampling_params, 0)
            return [sampling_params] * n
        if not isinstance(sampling_params, (list, tuple)):
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, "
                            f"got {type(sampling_params).__name__}")
        bad = next((i for i, p in enumerate(sampling_params) if not isinstance(p, SamplingParams)), None)
        if bad is not None:
            raise TypeError(f"sampling_params {bad} is {type(sampling_params[bad]).__name__}, "
                            "not SamplingParams")
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {n} prompts; "
                             "give one, or one per prompt")
        checked = set()
        for i, p in enumerate(sampling_params):
            if id(p) not in checked:   # one SamplingParams is often shared by every prompt
                self._check_params(p, i)
                checked.add(id(p))
        return list(sampling_params)

    def _output(self, seqs: list[Sequence], prompt) -> RequestOutput:
        first = seqs[0]
        prompt_logprobs = None
        if first.prompt_logprobs is not None:   # vLLM's shape: None for the first token, then one dict each
            prompt_logprobs = [None] + self._logprob_dicts(first.prompt_token_ids[1:], first.prompt_logprobs,
                                                           first.sampling_params.detokenize)
        return RequestOutput(str(first.seq_id), _prompt_text(prompt), first.prompt_token_ids,
                             [self._completion(seq) for seq in seqs], finished=True,
                             prompt_logprobs=prompt_logprobs, num_cached_tokens=first.num_cached_tokens or 0)

    def completion_output(self, seq: Sequence) -> CompletionOutput:
        """A finished sequence's CompletionOutput, as generate reports it (for streaming callers)."""
        return self._completion(seq)

    def _completion(self, seq: Sequence) -> CompletionOutput:
        ids, p = seq.completion_token_ids, seq.sampling_params
        if isinstance(seq.stop_reason, str):
            text = seq.detokenizer.text   # already cut at the stop string
        elif self.tokenizer is None or not p.detokenize:
            text = ""
        else:
            text = decode_output(self.tokenizer, seq.text_context, text_token_ids(seq),
                                 skip_special_tokens=p.skip_special_tokens,
                                 spaces_between_special_tokens=p.spaces_between_special_tokens)
        logprobs = self._logprob_dicts(ids, seq.logprobs, p.detokenize) if seq.logprobs is not None else None
        cumulative = sum(lp.logprob for lp in seq.logprobs) if seq.logprobs is not None else None
        return CompletionOutput(seq.index, text, ids, cumulative, logprobs,
                                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)

    def _logprob_dicts(self, ids: list[int], logprobs: list[TokenLogprobs],
                       detokenize: bool = True) -> list[dict[int, Logprob]]:
        """vLLM's shape: per token, {token id: Logprob}, the chosen (sampled or prompt) token first."""
        names: dict[int, str | None] = {}

        def name(t: int) -> str | None:
            if t not in names:
                names[t] = self.tokenizer.decode([t]) if self.tokenizer and detokenize else None
            return names[t]

        dicts = []
        for token, lp in zip(ids, logprobs):
            entry = {token: Logprob(lp.logprob, lp.rank, name(token))}
            for rank, (t, value) in enumerate(zip(lp.top_ids, lp.top_logprobs), start=1):
                entry.setdefault(t, Logprob(value, rank, name(t)))
            dicts.append(entry)
        return dicts


def add_prompt_logprobs(batch: ScheduledBatch, rows: dict[int, tuple[int, list[TokenLogprobs]]]):
    """Append a prefill step's prompt logprobs (seq_id -> first position, one entry per position).
    Positions already there are skipped: a sequence preempted before its last chunk's logprobs
    arrived computes them again."""
    for seq in batch.seqs:
        if seq.seq_id in rows:
            first, entries = rows[seq.seq_id]
            have = len(seq.prompt_logprobs)
            if first <= have:
                seq.prompt_logprobs.extend(entries[have - first:])


def text_token_ids(seq: Sequence) -> list[int]:
    """The output tokens whose text is the output's text. As in vLLM v1, the token that stopped the
    sequence (EOS or one of stop_token_ids) stays in token_ids, but its text is left out (whatever
    skip_special_tokens says) unless include_stop_str_in_output."""
    ids = seq.completion_token_ids
    stopped_by_token = seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str)
    if stopped_by_token and ids and not seq.sampling_params.include_stop_str_in_output:
        return ids[:-1]
    return ids


def _is_token_id(t) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def encode_text(tokenizer, text: str, where: str, add_special_tokens: bool = True) -> list[int]:
    """The tokenizer's ids for text; text that is not valid Unicode is a ValueError naming `where`."""
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except Exception:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:   # the tokenizer's own message does not say this
            bad = text[e.start:e.end]
            raise ValueError(f"{where}: its text is not valid Unicode ({e.reason}: {bad!r} at character "
                             f"{e.start}); a str prompt must encode to UTF-8") from None
        raise


def _unwrap_prompt_dict(prompt, where: str):
    """vLLM's prompt dicts -> their text or token ids: TextPrompt {"prompt": text} or TokensPrompt
    {"prompt_token_ids": ids, optionally "prompt": their text}."""
    if not isinstance(prompt, dict):
        return prompt
    unsupported = [k for k in UNSUPPORTED_PROMPT_KEYS if k in prompt]
    if unsupported:
        raise ValueError(f"{where}: prompt key(s) {unsupported} are not supported (nanovllm runs text-only "
                         "models with one shared prefix cache)")
    text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
    if unknown or (text is None and ids is None) or (text is not None and not isinstance(text, str)) \
            or (ids is not None and not isinstance(ids, (list, tuple))):
        raise TypeError(f"{where}: a prompt dict is {{'prompt': str}} (TextPrompt) or {{'prompt_token_ids': "
                        f"[int, ...]}} with an optional 'prompt' text (TokensPrompt); got {prompt!r:.80}")
    return ids if ids is not None else text


def _prompt_text(prompt) -> str | None:
    """RequestOutput.prompt: the prompt's text when the user gave one."""
    if isinstance(prompt, dict):
        return prompt.get("prompt")
    return prompt if isinstance(prompt, str) else None


def _as_prompt_list(prompts) -> list:
    """A single prompt (string, token-id list or vLLM prompt dict) or a list of prompts -> a list of
    prompts. A list that starts with a number is one token-id prompt (so [5, 6.0] is reported as a
    bad item of prompt 0, not as a bad prompt 0)."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                            and isinstance(prompts[0], numbers.Number)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError("prompts must be a string, a list of token ids, or a list of those; "
                        f"got {type(prompts).__name__}")
    return list(prompts)
