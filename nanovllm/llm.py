from nanovllm.engine.llm_engine import LLMEngine


class LLM(LLMEngine):
    """The user's entry point: `LLM(model, **options).generate(prompts, sampling_params)`."""
