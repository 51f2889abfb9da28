from tqdm.auto import tqdm

from nanovllm.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence, beam_score, extend
from nanovllm.chat_utils import chat_prompts
from nanovllm.engine.llm_engine import LLMEngine, serialised
from nanovllm.engine.progress import check_use_tqdm
from nanovllm.engine.requests import as_prompt_list, lora_per_prompt
from nanovllm.engine.pooling_requests import check_pooling_api
from nanovllm.engine.scoring import score
from nanovllm.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput,
                              RequestOutput, ScoringRequestOutput)
from nanovllm.pooling_params import PoolingParams
from nanovllm.sampling_params import SamplingParams


class LLM:
    """The user's entry point: `LLM(model, **options).generate(prompts, sampling_params)`, a facade
    over its engine, llm.llm_engine (as in vLLM): an LLMEngine or, with data_parallel_size=N > 1, a
    DataParallelEngine (N engines on Ray, the `ray` extra: distributed/data_parallel.py). Both have
    generate, get_tokenizer, get_default_sampling_params and shutdown, and what chat and beam_search,
    written here once, need: tokenizer, config, eos_token_ids, prompt_token_ids and one_call. Every
    other attribute read is the engine's (llm.scheduler, llm.step, llm.last_job, ...). On the pooling
    runner (runner="pooling": embeddings, classifiers, rerankers), embed, classify, score, reward and
    encode instead of generate."""

    def __init__(self, model: str, data_parallel_size: int = 1, **options):
        if type(data_parallel_size) is int and data_parallel_size == 1:
            self.llm_engine = LLMEngine(model, **options)
        else:
            from nanovllm.distributed.data_parallel import DataParallelEngine   # validates the value
            self.llm_engine = DataParallelEngine(model, data_parallel_size=data_parallel_size, **options)

    def __getattr__(self, name: str):
        # Only for names LLM itself lacks. (No engine yet: its construction failed.)
        if name == "llm_engine" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.llm_engine, name)

    def one_call(self):
        """The engine's: hold it for one call of this LLM (see LLMEngine.one_call)."""
        return self.llm_engine.one_call()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm=True, lora_request=None, priority=None) -> list[RequestOutput]:
        """vLLM's LLM.generate (see LLMEngine.generate)."""
        return self.llm_engine.generate(prompts, sampling_params, use_tqdm, lora_request, priority)

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        return self.llm_engine.get_default_sampling_params()

    def shutdown(self):
        self.llm_engine.shutdown()

    @serialised
    def beam_search(self, prompts, params: BeamSearchParams, lora_request=None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: for each prompt (a string, token ids or a prompt dict), the
        params.beam_width best beams of up to params.max_tokens tokens, best first. use_tqdm: one bar
        over the token steps; concurrency_limit: search at most this many prompts at a time (the
        same results, less memory); lora_request: one LoRARequest or one per prompt (None: the base
        model), as generate takes it."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        check_use_tqdm(use_tqdm)
        prompts = as_prompt_list(prompts)
        loras = lora_per_prompt(lora_request, len(prompts), self.config.enable_lora)
        cap = self.config.max_logprobs
        if cap != -1 and 2 * params.beam_width > cap:
            raise ValueError(f"beam_width={params.beam_width} needs the {2 * params.beam_width} most likely "
                             f"tokens each step, more than max_logprobs={cap}: use beam_width <= {cap // 2} "
                             "or raise LLM(max_logprobs=...) (-1: no cap)")
        if concurrency_limit is not None and (type(concurrency_limit) is not int or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit must be an integer >= 1 or None, got {concurrency_limit!r}")
        token_ids = self.llm_engine.prompt_token_ids(prompts)   # all checked first
        if any(loras) and hasattr(self.llm_engine, "requests"):   # folders checked before the search
            self.llm_engine.requests.lora_list(loras, len(loras))   # (data parallel: by the replicas)
        limit = concurrency_limit or max(len(prompts), 1)
        chunks = [(token_ids[i:i + limit], loras[i:i + limit]) for i in range(0, len(token_ids), limit)]
        bar = None
        if use_tqdm:   # one bar over the token steps, as vLLM's
            bar = (use_tqdm if callable(use_tqdm) else tqdm)(
                total=params.max_tokens * len(chunks), desc="Beam search", unit="token", dynamic_ncols=True)
        try:
            return [out for chunk, lora in chunks for out in self._beam_search(chunk, lora, params, bar)]
        finally:
            if bar is not None:
                bar.close()

    def _beam_search(self, token_ids: list[list[int]], loras: list, params: BeamSearchParams,
                     bar) -> list[BeamSearchOutput]:
        eos, max_model_len, tokenizer = self.eos_token_ids, self.config.max_model_len, self.tokenizer
        step = SamplingParams(temperature=params.temperature, max_tokens=1, logprobs=2 * params.beam_width,
                              ignore_eos=True, detokenize=False)
        beams = [[BeamSearchSequence(ids)] for ids in token_ids]
        completed = [[] for _ in token_ids]

        def key(beam):
            return beam_score(beam, eos, params.length_penalty)

        for steps_left in range(params.max_tokens, 0, -1):
            for done, live in zip(completed, beams):   # a beam at max_model_len can grow no more
                done += [b for b in live if len(b.tokens) >= max_model_len]
                live[:] = [b for b in live if len(b.tokens) < max_model_len]
            flat = [b for live in beams for b in live]
            flat_loras = [lora for live, lora in zip(beams, loras) for _ in live]
            if not flat:
                if bar is not None:
                    bar.update(steps_left)   # every beam ended early: the bar counts the steps it skips
                break
            outputs = iter(self.generate([b.tokens for b in flat], step, use_tqdm=False,
                                         lora_request=flat_loras if any(flat_loras) else None))
            if bar is not None:
                bar.update(1)
            for i, live in enumerate(beams):
                candidates = []
                for beam in live:
                    for new in extend(beam, next(outputs).outputs[0].logprobs[0]):
                        ended = new.tokens[-1] in eos and not params.ignore_eos
                        (completed[i] if ended else candidates).append(new)
                beams[i] = sorted(candidates, key=key, reverse=True)[:params.beam_width]
        results = []
        for done, live in zip(completed, beams):
            best = sorted(done + live, key=key, reverse=True)[:params.beam_width]
            for beam in best:
                beam.text = tokenizer.decode(beam.tokens) if tokenizer else None
                ended = beam.tokens[-1] in eos and not params.ignore_eos
                beam.finish_reason = "stop" if ended else "length"
            results.append(BeamSearchOutput(best))
        return results

    @serialised
    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm=True, lora_request=None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, mm_processor_kwargs: dict | None = None,
             tokenization_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's LLM.chat (its argument order): `messages` is one conversation (a list of {"role",
        "content"} dicts) or a list of them; each is rendered with the chat template (the
        tokenizer's, or `chat_template`) and generated from. continue_final_message: the last
        (assistant) message is continued rather than a new one started; tools: function definitions
        the template shows the model; lora_request: as generate takes it;
        mm_processor_kwargs, tokenization_kwargs: None or empty (text-only models, and the template
        writes the special tokens)."""
        for name, value in (("mm_processor_kwargs", mm_processor_kwargs),
                            ("tokenization_kwargs", tokenization_kwargs)):
            if value:
                raise ValueError(f"{name}: nanovllm takes none (text-only models, prompts tokenized as "
                                 f"the chat template wrote them); pass None, got {value!r}")
        prompts = chat_prompts(self.tokenizer, messages, chat_template=chat_template,
                               content_format=chat_template_content_format,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, tools=tools,
                               chat_template_kwargs=chat_template_kwargs)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    # ---- the pooling runner (vLLM's LLM.encode and its task-specific forms) ---------------------

    def encode(self, prompts, pooling_params: PoolingParams | list[PoolingParams] | None = None, *,
               use_tqdm=True, lora_request=None, pooling_task: str | None = None,
               tokenization_kwargs: dict | None = None) -> list[PoolingRequestOutput]:
        """vLLM's LLM.encode: each prompt's pooled output for pooling_task ("embed", "classify",
        "token_embed" or "token_classify"), outputs.data a tensor (see LLMEngine.encode)."""
        _check_no_tokenization_kwargs(tokenization_kwargs)
        return self._pooling_engine().encode(prompts, pooling_params, use_tqdm, lora_request, pooling_task)

    def embed(self, prompts, *, use_tqdm=True, pooling_params=None, lora_request=None,
              tokenization_kwargs: dict | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (outputs.embedding: a list of floats)."""
        check_pooling_api(self._pooling_engine().config.pooling, "embed", "LLM.embed()")
        outs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                           pooling_task="embed", tokenization_kwargs=tokenization_kwargs)
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(self, prompts, *, pooling_params=None, use_tqdm=True, lora_request=None,
                 tokenization_kwargs: dict | None = None) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (outputs.probs; the logits with use_activation=False)."""
        check_pooling_api(self._pooling_engine().config.pooling, "classify", "LLM.classify()")
        outs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                           pooling_task="classify", tokenization_kwargs=tokenization_kwargs)
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def reward(self, prompts, /, *, pooling_params=None, use_tqdm=True, lora_request=None,
               tokenization_kwargs: dict | None = None) -> list[PoolingRequestOutput]:
        """The score head on every token (outputs.data: [num_tokens, num_labels])."""
        return self.encode(prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                           pooling_task="token_classify", tokenization_kwargs=tokenization_kwargs)

    def score(self, data_1, data_2, /, *, use_tqdm=True, pooling_params: PoolingParams | None = None,
              lora_request=None, tokenization_kwargs: dict | None = None,
              chat_template: str | None = None) -> list[ScoringRequestOutput]:
        """A score per pair: data_1 and data_2 are a prompt or lists of them, paired 1:1, 1:N or N:N
        (see engine/scoring.py)."""
        _check_no_tokenization_kwargs(tokenization_kwargs)
        return score(self._pooling_engine(), data_1, data_2, use_tqdm=use_tqdm, pooling_params=pooling_params,
                     lora_request=lora_request, chat_template=chat_template)

    def _pooling_engine(self) -> LLMEngine:
        if not isinstance(self.llm_engine, LLMEngine):
            raise ValueError("pooling runs on one engine: create the LLM with data_parallel_size=1")
        return self.llm_engine


def _check_no_tokenization_kwargs(kwargs: dict | None):
    if kwargs:
        raise ValueError(f"tokenization_kwargs: nanovllm takes none (prompts are tokenized as the tokenizer "
                         f"does by default); pass None, got {kwargs!r}")
