"""vLLM's pooling outputs: PoolingRequestOutput (outputs.data, a tensor) and its views per task,
EmbeddingRequestOutput (outputs.embedding), ClassificationRequestOutput (outputs.probs) and
ScoringRequestOutput (outputs.score)."""
from dataclasses import dataclass

import torch


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
