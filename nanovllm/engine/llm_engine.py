"""The engine: tokenizer, executor (model runner and TP workers) and scheduler; add_request / step /
generate, one caller at a time, and a fresh engine again after any failure inside a call."""
import functools
import logging
import threading
import weakref
from contextlib import contextmanager

from nanovllm.config import Config
from nanovllm.engine.executor import Executor
from nanovllm.engine.generation_defaults import default_sampling_overrides
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.output_builder import OutputBuilder
from nanovllm.engine.pooling_requests import pooling_output, pooling_seqs
from nanovllm.engine.progress import Progress, check_use_tqdm
from nanovllm.engine.requests import RequestBuilder, as_prompt_list, check_priority
from nanovllm.engine.run_ahead import RunAhead
from nanovllm.engine.scheduler import ScheduledBatch, Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.stop_checker import ABORT
from nanovllm.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
from nanovllm.quantization import check_quantization
from nanovllm.sampling_params import SamplingParams
from nanovllm.spec.ngram import NgramProposer
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


def proposer_of(config: Config) -> NgramProposer | None:
    spec = config.speculative_config
    if spec is None:
        return None
    return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)


def log_acceptance(outputs: list[RequestOutput]):
    """One INFO line per generate call: how many drafts were checked and how many tokens accepted."""
    drafts = sum(o.metrics.num_drafts for o in outputs)
    proposed = sum(o.metrics.num_draft_tokens for o in outputs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outputs)
    logger.info("speculative decoding: %d drafts, %d draft tokens, %d accepted (%.1f%%; %.2f tokens per "
                "verify step)", drafts, proposed, accepted, 100 * accepted / max(proposed, 1),
                1 + accepted / max(drafts, 1))


class ShutDownDuringCall(RuntimeError):
    """shutdown() ran in another thread while this call was using the engine."""


def serialised(method):
    """Run an engine method as one call (see LLMEngine.one_call)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self.one_call():
            return method(self, *args, **kwargs)
    return locked


class LLMEngine:
    def __init__(self, model: str, **options):
        self._lock = threading.RLock()   # see one_call
        self._reset_owed = False   # a reset that a second interrupt cut short (see _reset_on_error)
        # Every sequence queued and still alive, so a reset ends them all, also one that was
        # between two queues when the failure came.
        self._queued: weakref.WeakSet[Sequence] = weakref.WeakSet()
        self.config = c = Config.create(model, **options)
        check_quantization(c)   # before any worker starts
        self.tokenizer = (None if c.skip_tokenizer_init
                          else load_tokenizer(c.tokenizer or c.model, c.tokenizer_mode))
        self.executor = Executor(c)   # rank 0's runner here, and the workers under TP
        eos_ids = eos_token_ids(c, self.tokenizer)
        state = self.model_runner.state_cache   # per-sequence state (linear attention), or None
        num_state_slots = state.num_slots if state is not None else 0
        prefix_caching = c.enable_prefix_caching and not num_state_slots
        if c.enable_prefix_caching and num_state_slots:
            logger.info("prefix caching is off for this hybrid model: a cached KV block would come "
                        "without the linear-attention state at its end, which is not cached")
        self.scheduler = Scheduler(c.max_num_seqs, c.max_num_batched_tokens, c.max_model_len,
                                   self.model_runner.num_kvcache_blocks, c.kvcache_block_size,
                                   eos_ids, prefix_caching, self.tokenizer,
                                   secondary_eos_token_ids(eos_ids, self.tokenizer),
                                   c.max_loras if c.enable_lora else 0, num_state_slots, proposer_of(c))
        # SamplingParams fields the model's generation config sets (used when none are given).
        self.default_sampling_overrides = default_sampling_overrides(c.model, c.generation_config)
        self.requests = RequestBuilder(c, self.tokenizer, self.model_runner.num_kvcache_blocks, eos_ids,
                                       self.default_sampling_overrides)
        if c.enable_lora:
            self.requests.lora_modules = self.model_runner.lora.modules
        self.outputs = OutputBuilder(self.tokenizer, c.speculative_config is not None)
        self.run_ahead = RunAhead(self.scheduler, self.executor, c.async_scheduling,
                                  c.speculative_config is not None)

    @property
    def model_runner(self) -> ModelRunner:
        return self.executor.runner

    def get_tokenizer(self):
        return self.tokenizer

    @property
    def eos_token_ids(self) -> set[int]:
        return self.scheduler.eos_token_ids

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
        return self.requests.default_params()

    def compile_grammar(self, params: StructuredOutputsParams):
        """See RequestBuilder.compile_grammar (a server compiles off its engine loop)."""
        return self.requests.compile_grammar(params)

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

    # ---- one call at a time, and whether the engine can still run ----------------------------

    @contextmanager
    def one_call(self):
        """One call of the engine, holding its lock, so threads sharing it take turns: a generate
        call runs from queueing its first sequence to building its last output with no other
        caller's step in between, and gives exactly the tokens it would alone. Re-entrant (chat and
        beam_search call generate).

        Whether the engine can still run is the executor's to say (Executor.check_can_run: shut
        down, a worker failed, or the ranks out of step); the engine keeps no such state of its own. Ranks
        out of step refuse every call here; a shut-down engine and a failed worker make the next
        launch raise their own errors. A reset that a second interrupt cut short is finished first:
        that engine runs on."""
        with self._lock:
            if self.executor.out_of_step:
                raise RuntimeError(f"this engine can no longer run: {self.executor.out_of_step}. "
                                   "Create a new LLM (and shut this one down)")
            if self._reset_owed:
                self._reset()
            was_closed = self.executor.closed
            try:
                yield
            except ShutDownDuringCall:
                raise   # from a call inside this one (chat calls generate)
            except Exception as e:
                if self.executor.closed and not was_closed:   # shutdown() from another thread released
                    raise ShutDownDuringCall(                   # what this call was using
                        "the engine was shut down (by another thread) during this call") from e
                raise

    @contextmanager
    def _reset_on_error(self):
        """Any exception or interrupt inside leaves the engine as a fresh one (see _reset). The
        owed flag covers an interrupt that lands in the recovery itself: the next call resets."""
        was_owed, self._reset_owed = self._reset_owed, True
        try:
            yield
        except BaseException:
            self._reset()
            raise
        self._reset_owed = was_owed

    def _reset(self):
        """After a failure anywhere in a call or step: drop the batch in flight, end every queued
        sequence with finish_reason "abort", and rebuild the scheduler's queues and blocks from
        nothing (the prefix cache too), since an interrupt may have landed between any two
        updates of them. The model runner needs nothing: a new sequence reads no state of an old one."""
        self._reset_owed = True
        self.run_ahead.reset()
        for seq in list(self._queued):
            seq.abort()
        self._queued.clear()
        self.scheduler.reset()
        if self.model_runner.lora is not None:   # a step may have taken slots it never loaded
            self.model_runner.lora.slots.reset()
        self._reset_owed = False

    # ---- requests -------------------------------------------------------------------------

    @serialised
    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None, *,
                    prompt_index: int = 0, lora_request=None) -> list[Sequence]:
        """Queue one prompt; return its sampling_params.n sequences (completions 0..n-1).
        prompt_index: the prompt's place in its caller's batch, which error messages name;
        lora_request: its adapter's LoRARequest (None: the base model)."""
        self._check_generates()
        params = self.requests.params_list(sampling_params, 1)[0]
        ids = self.requests.token_ids(prompt, prompt_index, params.truncate_prompt_tokens)
        lora = self.requests.lora_list(lora_request, 1)[0]
        seqs = self.requests.new_seqs(ids, params, lora)
        with self._reset_on_error():
            self._queue(seqs)
        return seqs

    def _check_generates(self):
        if self.config.pooling is not None:
            raise ValueError("generation is only supported for generative models; this LLM runs the pooling "
                             "runner: use embed / classify / score / encode, or create it with "
                             "runner='generate'")

    def prompt_token_ids(self, prompts) -> list[list[int]]:
        """Each prompt's checked token ids (errors name its index), queueing nothing."""
        return [self.requests.token_ids(p, i) for i, p in enumerate(as_prompt_list(prompts))]

    def _queue(self, seqs: list[Sequence]):
        self._queued.update(seqs)
        for seq in seqs:
            self.scheduler.add(seq)

    @serialised
    def abort(self, seqs: list[Sequence]):
        """Stop these sequences now (their client went away) and free their KV blocks; a token
        still in flight for one of them is dropped when it arrives."""
        with self._reset_on_error():
            for seq in seqs:
                self.scheduler.finish(seq, ABORT)

    def completion_output(self, seq: Sequence) -> CompletionOutput:
        """A finished sequence's CompletionOutput, as generate reports it (for streaming callers)."""
        return self.outputs.completion(seq)

    # ---- stepping -------------------------------------------------------------------------

    @serialised
    def step(self) -> tuple[list[Sequence], ScheduledBatch]:
        """Schedule one batch and launch it; then apply the results of the batch launched before
        it. The host so does its bookkeeping while the device computes, and waits only for
        tokens of the previous batch (async_scheduling; otherwise each batch is applied at once:
        see run_ahead.py). Returns the sequences that finished, and the batch launched. An
        exception aborts every queued request (see _reset)."""
        with self._reset_on_error():
            return self.run_ahead.step()

    @serialised
    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and self.run_ahead.in_flight is None

    @serialised
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm=True, lora_request=None, priority=None) -> list[RequestOutput]:
        """vLLM's LLM.generate: one RequestOutput per prompt, in prompt order. use_tqdm: show a
        progress bar (True), none (False), or draw it with this tqdm-like callable. lora_request:
        a LoRARequest for every prompt, or a list of one per prompt (None: the base model), with
        LLM(enable_lora=True); priority: see check_priority. Threads may share an engine: their
        calls are served one after another (see one_call). An exception or Ctrl-C anywhere inside leaves the
        engine as a fresh one (see _reset)."""
        check_use_tqdm(use_tqdm)
        self._check_generates()
        prompts = as_prompt_list(prompts)
        check_priority(priority, len(prompts))
        params = self.requests.params_list(sampling_params, len(prompts))
        loras = self.requests.lora_list(lora_request, len(prompts))
        # all checked before any is queued
        token_ids = [self.requests.token_ids(p, i, sp.truncate_prompt_tokens)
                     for i, (p, sp) in enumerate(zip(prompts, params))]
        per_prompt = [self.requests.new_seqs(ids, sp, lr) for ids, sp, lr in zip(token_ids, params, loras)]
        with self._reset_on_error():
            self._queue([seq for seqs in per_prompt for seq in seqs])
            self._run_until_done(per_prompt, use_tqdm)
            self.run_ahead.apply_in_flight()   # the last batch's results are for finished sequences
            outputs = [self.outputs.request_output(seqs, p) for seqs, p in zip(per_prompt, prompts)]
            if self.config.speculative_config is not None:
                log_acceptance(outputs)
            return outputs

    @serialised
    def encode(self, prompts, pooling_params=None, use_tqdm=True, lora_request=None,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """vLLM's LLM.encode on the pooling runner: one PoolingRequestOutput per prompt, in prompt
        order; each prompt is computed once (in chunks when long) and its KV blocks freed as soon as
        it is pooled (layers/pooler.py)."""
        check_use_tqdm(use_tqdm)
        prompts = as_prompt_list(prompts)
        seqs = pooling_seqs(self.requests, self.config.pooling, prompts, pooling_params, pooling_task,
                            lora_request)
        with self._reset_on_error():
            self._queue(seqs)
            self._run_until_done([[seq] for seq in seqs], use_tqdm)
            self.run_ahead.apply_in_flight()
            return [pooling_output(seq) for seq in seqs]

    def _run_until_done(self, per_prompt: list[list[Sequence]], use_tqdm):
        progress = Progress(use_tqdm, len(per_prompt))
        prompt_of = {seq.seq_id: i for i, seqs in enumerate(per_prompt) for seq in seqs}
        unfinished = [len(seqs) for seqs in per_prompt]   # sequences left per prompt (for the bar)
        all_seqs = [seq for seqs in per_prompt for seq in seqs]
        try:
            while not all(seq.is_finished for seq in all_seqs):
                finished, _ = self.run_ahead.step()   # generate holds the lock and resets on errors
                done = []   # the prompts this step finished (each its n sequences)
                for seq in finished:
                    i = prompt_of.get(seq.seq_id)
                    if i is not None:
                        unfinished[i] -= 1
                        if unfinished[i] == 0:
                            done.append(per_prompt[i])
                if done:   # as vLLM counts them: each completion's prompt tokens, and its output tokens
                    progress.finished(len(done), sum(s.num_prompt_tokens for r in done for s in r),
                                      sum(s.num_completion_tokens for r in done for s in r))
        finally:
            summary = progress.close()
        if not self.config.disable_log_stats:
            logger.info("generate: %d prompts, %s", len(per_prompt), summary)
