"""The engine: tokenizer, model runner and scheduler; add_request / step / generate."""
import os
import time

from tqdm.auto import tqdm
from transformers import AutoTokenizer, GenerationConfig

from nanovllm.config import Config
from nanovllm.engine.block_manager import cdiv
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.scheduler import ScheduledBatch, Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.loader import resolve_model

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str):
    """The folder's tokenizer, or None when it has none (then prompts must be token ids)."""
    if not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(path)


def eos_token_ids(config: Config, tokenizer) -> set[int]:
    """EOS ids from the model config, generation_config.json and the tokenizer, together."""
    ids = set()
    sources = [config.hf_config.eos_token_id, tokenizer.eos_token_id if tokenizer else None]
    try:
        sources.append(GenerationConfig.from_pretrained(config.model).eos_token_id)
    except OSError:
        pass
    for src in sources:
        ids.update([src] if isinstance(src, int) else (src or []))
    return ids


class LLMEngine:
    def __init__(self, model: str, **options):
        self.config = Config.create(resolve_model(model), **options)
        self.tokenizer = load_tokenizer(self.config.model)
        self.model_runner = ModelRunner(self.config)
        c = self.config
        self.scheduler = Scheduler(c.max_num_seqs, c.max_num_batched_tokens, c.max_model_len,
                                   self.model_runner.num_kvcache_blocks, c.kvcache_block_size,
                                   eos_token_ids(c, self.tokenizer))

    # ---- requests -------------------------------------------------------------------------

    def _token_ids(self, prompt, index: int) -> list[int]:
        """Validate one prompt and return its token ids; errors name the prompt's index."""
        where = f"prompt {index}"
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{where}: the model folder has no tokenizer, so prompts must be token-id lists")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise TypeError(f"{where}: a token-id prompt must be a list of ints")
            ids = list(prompt)
        else:
            raise TypeError(f"{where}: expected a string or a list of token ids, got {type(prompt).__name__}")
        vocab = self.config.hf_config.vocab_size
        if not ids:
            raise ValueError(f"{where} is empty")
        if not all(0 <= t < vocab for t in ids):
            raise ValueError(f"{where}: token ids must be in [0, {vocab}) (the model's vocabulary)")
        if len(ids) > self.config.max_model_len:
            raise ValueError(f"{where} has {len(ids)} tokens, more than max_model_len={self.config.max_model_len}")
        blocks = self.model_runner.num_kvcache_blocks
        if cdiv(len(ids), self.config.kvcache_block_size) > blocks:
            raise ValueError(f"{where} has {len(ids)} tokens and cannot fit in the whole KV cache "
                             f"({blocks} blocks of {self.config.kvcache_block_size}); give the cache more memory")
        return ids

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None) -> Sequence:
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        seq = Sequence(self._token_ids(prompt, 0), params)
        self.scheduler.add(seq)
        return seq

    # ---- stepping -------------------------------------------------------------------------

    def step(self) -> tuple[list[Sequence], ScheduledBatch]:
        """Schedule one batch, run it, apply the results; return the sequences that finished."""
        batch = self.scheduler.schedule()
        token_ids = self.model_runner.run(batch)
        return self.scheduler.postprocess(batch, token_ids), batch

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        params = self._params_list(sampling_params, len(prompts))
        token_ids = [self._token_ids(p, i) for i, p in enumerate(prompts)]   # all checked before any is queued
        seqs = [Sequence(ids, sp) for ids, sp in zip(token_ids, params)]
        for seq in seqs:
            self.scheduler.add(seq)
        try:
            self._run_until_done(seqs, use_tqdm)
        except BaseException:
            self.scheduler.abort_all()   # leave the engine empty and usable
            raise
        return [self._output(seq, p) for seq, p in zip(seqs, prompts)]

    def _run_until_done(self, seqs: list[Sequence], use_tqdm: bool):
        bar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_tps = decode_tps = 0.0
        with bar:
            while not all(seq.is_finished for seq in seqs):
                t = time.perf_counter()
                finished, batch = self.step()
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
            return [sampling_params] * n
        if not isinstance(sampling_params, (list, tuple)) or \
                not all(isinstance(p, SamplingParams) for p in sampling_params):
            raise TypeError("sampling_params must be a SamplingParams or a list of them")
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {n} prompts; give one, or one per prompt")
        return list(sampling_params)

    def _output(self, seq: Sequence, prompt) -> RequestOutput:
        ids = seq.completion_token_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""
        completion = CompletionOutput(0, text, ids, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
        return RequestOutput(str(seq.seq_id), prompt if isinstance(prompt, str) else None,
                             seq.prompt_token_ids, [completion], finished=True)


def _as_prompt_list(prompts) -> list:
    """A single prompt (string or token-id list) or a list of prompts -> a list of prompts."""
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                    and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a string, a list of token ids, or a list of those; got {type(prompts).__name__}")
    return list(prompts)
