from nanovllm.engine.llm_engine import LLMEngine, serialised
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams


class LLM(LLMEngine):
    """The user's entry point: `LLM(model, **options).generate(prompts, sampling_params)`.
    With data_parallel_size=N > 1 it returns a DataParallelLLM instead: N engines on Ray (the `ray`
    extra), with the same generate / chat / get_tokenizer / shutdown."""

    def __new__(cls, model: str, data_parallel_size: int = 1, **options):
        if type(data_parallel_size) is int and data_parallel_size == 1:
            return super().__new__(cls)
        from nanovllm.distributed.data_parallel import DataParallelLLM   # validates the value
        return DataParallelLLM(model, data_parallel_size=data_parallel_size, **options)

    def __init__(self, model: str, data_parallel_size: int = 1, **options):
        super().__init__(model, **options)

    def get_tokenizer(self):
        return self.tokenizer

    @serialised
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
