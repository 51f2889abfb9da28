"""The engine: tokenizer, model runner and scheduler; add_request / step / generate."""
import functools
import numbers
import threading
import time
import weakref
from contextlib import contextmanager

from tqdm.auto import tqdm

from nanovllm.config import Config
from nanovllm.engine.block_manager import cdiv
from nanovllm.engine.executor import Executor
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.sampled_tokens import PendingSample
from nanovllm.engine.scheduler import ScheduledBatch, Scheduler
from nanovllm.engine.sequence import Sequence, TokenLogprobs
from nanovllm.engine.stop_checker import ABORT
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.structured.params import StructuredOutputsParams
from nanovllm.utils.hf_files import generation_eos_token_id, load_tokenizer
from nanovllm.utils.loader import resolve_model


def eos_token_ids(config: Config, tokenizer) -> set[int]:
    """EOS ids from the model config, generation_config.json and the tokenizer, together."""
    ids = set()
    sources = [config.hf_config.eos_token_id, tokenizer.eos_token_id if tokenizer else None,
               generation_eos_token_id(config.model)]
    for src in sources:
        ids.update([src] if isinstance(src, int) else (src or []))
    return ids


def serialised(method):
    """Run an engine method holding the engine's lock, so threads sharing one engine take turns: a
    generate call runs from queueing its first sequence to building its last output with no other
    caller's step in between, and gives exactly the tokens it would alone. Also refuses a broken
    engine, and finishes a reset that a second interrupt cut short."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            if self._broken is not None:
                raise RuntimeError(f"this engine can no longer run: {self._broken}. Create a new LLM "
                                   "(and shut this one down)")
            if self._dirty:
                self._reset()
            return method(self, *args, **kwargs)
    return locked


class LLMEngine:
    def __init__(self, model: str, **options):
        self._lock = threading.RLock()   # see serialised
        self._dirty = False   # the bookkeeping may be half-updated: reset it before the next call
        self._broken: str | None = None   # why the engine cannot run any more steps
        # Every sequence queued and still alive, so a reset ends them all, also one that was
        # between two queues when the failure came.
        self._queued: weakref.WeakSet[Sequence] = weakref.WeakSet()
        self.config = Config.create(resolve_model(model), **options)
        self.tokenizer = load_tokenizer(self.config.tokenizer or self.config.model)
        self.executor = Executor(self.config)   # rank 0's runner here, and the workers under TP
        c = self.config
        self.scheduler = Scheduler(c.max_num_seqs, c.max_num_batched_tokens, c.max_model_len,
                                   self.model_runner.num_kvcache_blocks, c.kvcache_block_size,
                                   eos_token_ids(c, self.tokenizer), c.enable_prefix_caching, self.tokenizer)
        # The launched batch whose tokens have not been applied yet (see step).
        self._in_flight: tuple[ScheduledBatch, PendingSample] | None = None
        self._grammar_compiler = None   # built by the first request with structured_outputs

    @property
    def model_runner(self) -> ModelRunner:
        return self.executor.runner

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

    def _token_ids(self, prompt, index: int) -> list[int]:
        """Validate one prompt and return its token ids; errors name the prompt's index."""
        where = f"prompt {index}"
        prompt = _unwrap_prompt_dict(prompt, where)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{where}: the model folder has no tokenizer, so prompts must be token-id lists")
            ids = _encode(self.tokenizer, prompt, where)
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
        vocab = self.config.hf_config.vocab_size
        if not ids:
            raise ValueError(f"{where} is empty" + (" (its text has no tokens)" if isinstance(prompt, str) else ""))
        if min(ids) < 0 or max(ids) >= vocab:
            bad = next(i for i, t in enumerate(ids) if not 0 <= t < vocab)
            raise ValueError(f"{where}: token id {ids[bad]} at position {bad} is outside the model's "
                             f"vocabulary [0, {vocab})")
        if len(ids) > self.config.max_model_len:
            raise ValueError(f"{where} has {len(ids)} tokens, more than max_model_len={self.config.max_model_len}; "
                             "shorten it or raise max_model_len")
        blocks = self.model_runner.num_kvcache_blocks
        if cdiv(len(ids), self.config.kvcache_block_size) > blocks:
            raise ValueError(f"{where} has {len(ids)} tokens and cannot fit in the whole KV cache "
                             f"({blocks} blocks of {self.config.kvcache_block_size} tokens); give the cache more "
                             "memory (gpu_memory_utilization, kv_cache_memory_bytes or num_kvcache_blocks)")
        return ids

    @serialised
    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None) -> list[Sequence]:
        """Queue one prompt; return its sampling_params.n sequences (completions 0..n-1)."""
        params = self._params_list(sampling_params, 1)[0]
        seqs = self._new_seqs(self._token_ids(prompt, 0), params)
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
            raise ValueError(f"sampling_params {index}: stop_token_ids must be in [0, {vocab}) (the model's vocabulary)")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"sampling_params {index}: stop strings need a tokenizer; the model folder has none "
                             "(use stop_token_ids)")
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
                raise ValueError("structured outputs need a tokenizer; the model folder has none "
                                 "(pass tokenizer=FOLDER)")
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
        return [Sequence(token_ids, params, index=i, eos_token_ids=eos,
                         grammar=GrammarState(compiled) if compiled is not None else None)
                for i in range(params.n)]   # each completion its own matcher

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
            finished += self._apply(*self._in_flight)
            self._in_flight = None
        batch = self.scheduler.schedule()
        launched = None
        if batch.seqs:
            try:
                launched = batch, self.executor.launch(batch)
            except BaseException as e:
                self._break_tp_step(e)
                raise
            self.scheduler.advance(batch)
        else:
            finished += batch.finished   # sequences ended while scheduling, with nothing to run
        if self._in_flight:
            finished += self._apply(*self._in_flight)
        self._in_flight = launched
        if launched and not self.config.async_scheduling:
            finished += self._apply(*launched)
            self._in_flight = None
        return finished, batch

    def _break_tp_step(self, error: BaseException):
        """A launch under tensor parallelism failed or was interrupted: the workers may have run
        (or be waiting in) a step that rank 0 did not finish, so the ranks are out of step and
        the next collective would hang or mix two steps. Mark the engine broken."""
        if self.executor.workers is None or self.executor.closed:
            return   # one rank: nothing to fall out of step with; shut down: every call says so
        self._broken = self.executor.broken or (
            f"a step under tensor parallelism was cut short ({type(error).__name__}: {error}), "
            "so the ranks may be out of step")

    def _can_run_ahead(self, batch: ScheduledBatch) -> bool:
        """May the next batch be launched before this one's tokens are on the host? Not with
        penalties: their token counts are built on the host from the known tokens; nor with a
        grammar: its next token bitmask needs the token just sampled. (Without async_scheduling
        nothing is left in flight to ask about.)"""
        return not any(seq.sampling_params.has_penalties or seq.grammar is not None
                       for seq in batch.sampling_seqs)

    def _apply(self, batch: ScheduledBatch, pending: PendingSample) -> list[Sequence]:
        """Wait for a launched batch's tokens and apply them; return the sequences that finished."""
        sampled = self.executor.result(pending)
        return self.scheduler.complete(batch, sampled.token_ids, sampled.logprobs)

    def _drain(self):
        """Apply the batch still in flight, if any (results for finished sequences are dropped)."""
        if self._in_flight:
            batch, pending = self._in_flight
            self._in_flight = None
            self._apply(batch, pending)

    @serialised
    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and self._in_flight is None

    @serialised
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Threads may share an engine: their calls are served one after another (see serialised).
        An exception or Ctrl-C anywhere inside leaves the engine as a fresh one (see _reset)."""
        prompts = _as_prompt_list(prompts)
        params = self._params_list(sampling_params, len(prompts))
        token_ids = [self._token_ids(p, i) for i, p in enumerate(prompts)]   # all checked before any is queued
        requests = [self._new_seqs(ids, sp) for ids, sp in zip(token_ids, params)]
        seqs = [seq for request in requests for seq in request]
        with self._reset_on_error():
            self._queue(seqs)
            self._run_until_done(seqs, use_tqdm)
            self._drain()
            return [self._output(request, p) for request, p in zip(requests, prompts)]

    def _run_until_done(self, seqs: list[Sequence], use_tqdm: bool):
        bar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_tps = decode_tps = 0.0
        with bar:
            while not all(seq.is_finished for seq in seqs):
                t = time.perf_counter()
                finished, batch = self._step()
                dt = max(time.perf_counter() - t, 1e-9)
                if batch.is_prefill:
                    prefill_tps = batch.num_tokens / dt
                elif batch.seqs:
                    decode_tps = len(batch.seqs) / dt
                bar.set_postfix(prefill=f"{prefill_tps:.0f}tok/s", decode=f"{decode_tps:.0f}tok/s")
                bar.update(len(finished))

    def _params_list(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            self._check_params(sampling_params, 0)
            return [sampling_params] * n
        if not isinstance(sampling_params, (list, tuple)):
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, "
                            f"got {type(sampling_params).__name__}")
        bad = next((i for i, p in enumerate(sampling_params) if not isinstance(p, SamplingParams)), None)
        if bad is not None:
            raise TypeError(f"sampling_params {bad} is {type(sampling_params[bad]).__name__}, not SamplingParams")
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {n} prompts; give one, or one per prompt")
        checked = set()
        for i, p in enumerate(sampling_params):
            if id(p) not in checked:   # one SamplingParams is often shared by every prompt
                self._check_params(p, i)
                checked.add(id(p))
        return list(sampling_params)

    def _output(self, seqs: list[Sequence], prompt) -> RequestOutput:
        first = seqs[0]
        prompt = _unwrap_prompt_dict(prompt, "")
        return RequestOutput(str(first.seq_id), prompt if isinstance(prompt, str) else None,
                             first.prompt_token_ids, [self._completion(seq) for seq in seqs], finished=True)

    def completion_output(self, seq: Sequence) -> CompletionOutput:
        """A finished sequence's CompletionOutput, as generate reports it (for streaming callers)."""
        return self._completion(seq)

    def _completion(self, seq: Sequence) -> CompletionOutput:
        ids, p = seq.completion_token_ids, seq.sampling_params
        if isinstance(seq.stop_reason, str):
            text = seq.detokenizer.text   # already cut at the stop string
        else:
            text = self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens) if self.tokenizer else ""
        logprobs = self._logprob_dicts(ids, seq.logprobs) if seq.logprobs is not None else None
        cumulative = sum(lp.logprob for lp in seq.logprobs) if seq.logprobs is not None else None
        return CompletionOutput(seq.index, text, ids, cumulative, logprobs,
                                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)

    def _logprob_dicts(self, ids: list[int], logprobs: list[TokenLogprobs]) -> list[dict[int, Logprob]]:
        """vLLM's shape: per output token, {token id: Logprob}, the sampled token first."""
        names: dict[int, str | None] = {}

        def name(t: int) -> str | None:
            if t not in names:
                names[t] = self.tokenizer.decode([t]) if self.tokenizer else None
            return names[t]

        dicts = []
        for token, lp in zip(ids, logprobs):
            entry = {token: Logprob(lp.logprob, lp.rank, name(token))}
            for rank, (t, value) in enumerate(zip(lp.top_ids, lp.top_logprobs), start=1):
                entry.setdefault(t, Logprob(value, rank, name(t)))
            dicts.append(entry)
        return dicts


def _is_token_id(t) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def _encode(tokenizer, text: str, where: str) -> list[int]:
    try:
        return tokenizer.encode(text)
    except Exception:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:   # the tokenizer's own message does not say this
            bad = text[e.start:e.end]
            raise ValueError(f"{where}: its text is not valid Unicode ({e.reason}: {bad!r} at character "
                             f"{e.start}); a str prompt must encode to UTF-8") from None
        raise


def _unwrap_prompt_dict(prompt, where: str):
    """vLLM's prompt dicts: {"prompt": text} (TextPrompt) or {"prompt_token_ids": ids} (TokensPrompt)."""
    if not isinstance(prompt, dict):
        return prompt
    if set(prompt) == {"prompt"} and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    if set(prompt) == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], (list, tuple)):
        return prompt["prompt_token_ids"]
    raise TypeError(f"{where}: a prompt dict must have exactly one key, 'prompt' (a string) or "
                    f"'prompt_token_ids' (a list of ints); got {prompt!r:.80}")


def _as_prompt_list(prompts) -> list:
    """A single prompt (string, token-id list or vLLM prompt dict) or a list of prompts -> a list of
    prompts. A list that starts with a number is one token-id prompt (so [5, 6.0] is reported as a
    bad item of prompt 0, not as a bad prompt 0)."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                            and isinstance(prompts[0], numbers.Number)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a string, a list of token ids, or a list of those; got {type(prompts).__name__}")
    return list(prompts)
