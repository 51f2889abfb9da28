"""vLLM-shaped results: one RequestOutput per prompt, holding its CompletionOutputs; and the pooling
runner's PoolingRequestOutput (outputs.data, a tensor) with its views per task: EmbeddingRequestOutput
(outputs.embedding), ClassificationRequestOutput (outputs.probs), ScoringRequestOutput (outputs.score)."""
from dataclasses import dataclass, field

import torch


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
class SpecDecodingMetrics:
    """A request's speculative decoding counts, as vLLM's SpecDecodingStats names them."""
    num_drafts: int = 0               # verify steps that checked drafts
    num_draft_tokens: int = 0         # draft tokens proposed and checked
    num_accepted_tokens: int = 0      # of those, accepted by the target model

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


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
    # vLLM's field: None, except with speculative decoding (SpecDecodingMetrics, over the n completions)
    metrics: "SpecDecodingMetrics | None" = None
    lora_request: object = None           # the request's LoRARequest (None: the base model)

    def __getitem__(self, key: str):
        # nano-vllm style: out["text"], out["token_ids"] read the first completion
        if key in ("text", "token_ids"):
            return getattr(self.outputs[0], key)
        raise KeyError(key)


@dataclass
class PoolingOutput:
    data: torch.Tensor   # [D] for a sequence-wise task, [num_tokens, D] for a token-wise one (fp32, CPU)


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0   # prompt tokens whose KV came from the prefix cache
    finished: bool = True


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @classmethod
    def from_base(cls, output: PoolingOutput) -> "EmbeddingOutput":
        if output.data.dim() != 1:
            raise ValueError(f"an embedding is one vector; this output has shape {tuple(output.data.shape)}")
        return cls(output.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @classmethod
    def from_base(cls, output: PoolingOutput) -> "ClassificationOutput":
        if output.data.dim() != 1:
            raise ValueError(f"class probabilities are one vector; this output has shape "
                             f"{tuple(output.data.shape)}")
        return cls(output.data.tolist())

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float

    @classmethod
    def from_base(cls, output: PoolingOutput) -> "ScoringOutput":
        if output.data.numel() != 1:
            raise ValueError(f"a score is one number; this output has shape {tuple(output.data.shape)}")
        return cls(float(output.data.reshape(-1)[0]))


def _from_base(cls, base: PoolingRequestOutput, output_class):
    return cls(base.request_id, output_class.from_base(base.outputs), base.prompt_token_ids,
               base.num_cached_tokens, base.finished)


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    outputs: EmbeddingOutput

    @classmethod
    def from_base(cls, base: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return _from_base(cls, base, EmbeddingOutput)


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    outputs: ClassificationOutput

    @classmethod
    def from_base(cls, base: PoolingRequestOutput) -> "ClassificationRequestOutput":
        return _from_base(cls, base, ClassificationOutput)


@dataclass
class ScoringRequestOutput(PoolingRequestOutput):
    outputs: ScoringOutput

    @classmethod
    def from_base(cls, base: PoolingRequestOutput) -> "ScoringRequestOutput":
        return _from_base(cls, base, ScoringOutput)
