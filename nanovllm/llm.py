from nanovllm.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence, beam_score, extend
from nanovllm.engine.llm_engine import LLMEngine, _as_prompt_list
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams


class LLM(LLMEngine):
    """The user's entry point: `LLM(model, **options).generate(prompts, sampling_params)`."""

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM scripts reach the engine as llm.llm_engine (get_tokenizer, ...); here the LLM is one."""
        return self

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: for each prompt (a string, token ids or a prompt dict), the
        params.beam_width best beams of up to params.max_tokens tokens, best first."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        prompts = _as_prompt_list(prompts)
        eos = self.scheduler.eos_token_ids
        step = SamplingParams(temperature=params.temperature, max_tokens=1, logprobs=2 * params.beam_width,
                              ignore_eos=True, detokenize=False)
        beams = [[BeamSearchSequence(self._token_ids(p, i))] for i, p in enumerate(prompts)]
        completed = [[] for _ in prompts]

        def key(beam):
            return beam_score(beam, eos, params.length_penalty)

        for _ in range(params.max_tokens):
            for done, live in zip(completed, beams):   # a beam at max_model_len can grow no more
                done += [b for b in live if len(b.tokens) >= self.config.max_model_len]
                live[:] = [b for b in live if len(b.tokens) < self.config.max_model_len]
            flat = [b for live in beams for b in live]
            if not flat:
                break
            outputs = iter(self.generate([b.tokens for b in flat], step, use_tqdm=use_tqdm))
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
                beam.text = self.tokenizer.decode(beam.tokens) if self.tokenizer else None
                ended = beam.tokens[-1] in eos and not params.ignore_eos
                beam.finish_reason = "stop" if ended else "length"
            results.append(BeamSearchOutput(best))
        return results

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's LLM.chat: `messages` is one conversation (a list of {"role", "content"} dicts) or a
        list of them; each is rendered with the tokenizer's chat template and generated from."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("chat needs a tokenizer with a chat template (tokenizer.chat_template); "
                             "this model folder has none: use generate with a formatted prompt")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise TypeError("messages must be a conversation (a list of message dicts) or a list of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(list(c), tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      **(chat_template_kwargs or {}))
                   for c in conversations]
        # The template already writes any BOS it wants; encoding must not add another.
        ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        outputs = self.generate(ids, sampling_params, use_tqdm=use_tqdm)
        for out, prompt in zip(outputs, prompts):
            out.prompt = prompt
        return outputs
