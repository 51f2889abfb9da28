"""vLLM-shaped results: one RequestOutput per prompt, holding its CompletionOutputs."""
from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float                      # log probability of the model's raw output (vLLM v1 default)
    rank: int                           # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None   # one dict per output token
    finish_reason: str | None = None      # "stop" or "length"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    lora_request: object = None           # vLLM's field: the request's LoRARequest (None: base model)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    # SamplingParams.prompt_logprobs: None for the first prompt token, then {token id: Logprob} per token
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0            # prompt tokens whose KV came from the prefix cache
    metrics: None = None                  # vLLM's field, for scripts that read it: no per-request
                                          # metrics are kept
    lora_request: object = None           # the request's LoRARequest (None: the base model)

    def __getitem__(self, key: str):
        # nano-vllm style: out["text"], out["token_ids"] read the first completion
        if key in ("text", "token_ids"):
            return getattr(self.outputs[0], key)
        raise KeyError(key)
