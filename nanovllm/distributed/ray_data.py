"""A Ray Data building block: one engine per Ray Data actor, mapping batches of prompts (or chat
conversations) to generated text. Use it as

    ds.map_batches(NanoVLLMPredictor, fn_constructor_kwargs=dict(model=..., sampling_params=...),
                   concurrency=N, num_gpus=tensor_parallel_size, batch_size=...)
"""
import numpy as np

from nanovllm.chat_utils import chat_prompts
from nanovllm.distributed.ray_utils import import_ray
from nanovllm.sampling_params import SamplingParams


class NanoVLLMPredictor:
    """Reads the `prompt_column` (text or token ids) or, when the batch has no such column, the
    `messages_column` (a chat conversation per row); adds `generated_text`, `num_input_tokens`,
    `num_generated_tokens` and `finish_reason` (of the first completion). Other columns pass through."""

    def __init__(self, model: str, sampling_params: SamplingParams | dict | None = None,
                 prompt_column: str = "prompt", messages_column: str = "messages", **engine_options):
        import_ray()   # built by Ray Data; without Ray, say which extra is missing
        from nanovllm.engine.llm_engine import LLMEngine
        if isinstance(sampling_params, dict):
            sampling_params = SamplingParams(**sampling_params)
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams or a dict of its fields, "
                            f"got {type(sampling_params).__name__}")
        self.params = sampling_params or SamplingParams()
        self.prompt_column, self.messages_column = prompt_column, messages_column
        self.llm = LLMEngine(model, **engine_options)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # batch: {column: [batch_size] array} (Ray Data's "numpy" batch format)
        if self.prompt_column in batch:
            outputs = self.llm.generate([_plain(p) for p in batch[self.prompt_column]], self.params,
                                        use_tqdm=False)
        elif self.messages_column in batch:
            conversations = [[dict(m) for m in _plain(c)] for c in batch[self.messages_column]]
            outputs = self.llm.generate(chat_prompts(self.llm.tokenizer, conversations), self.params,
                                        use_tqdm=False)
        else:
            raise KeyError(f"the batch has neither a {self.prompt_column!r} nor a {self.messages_column!r} "
                           f"column (columns: {sorted(batch)}); set prompt_column or messages_column")
        firsts = [o.outputs[0] for o in outputs]
        return {**batch,
                "generated_text": np.array([c.text for c in firsts], dtype=object),
                "num_input_tokens": np.array([len(o.prompt_token_ids) for o in outputs], dtype=np.int64),
                "num_generated_tokens": np.array([len(c.token_ids) for c in firsts], dtype=np.int64),
                "finish_reason": np.array([c.finish_reason for c in firsts], dtype=object)}


def _plain(value):
    """Arrow/numpy cells as plain Python: a token-id array becomes a list of ints, a string stays."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value.item() if isinstance(value, np.generic) else value
