from nanovllm.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from nanovllm.engine.arg_utils import EngineArgs
from nanovllm.inputs import TextPrompt, TokensPrompt
from nanovllm.llm import LLM
from nanovllm.lora.request import LoRARequest
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.pooling.config import PoolerConfig
from nanovllm.pooling.outputs import (ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput,
                                      EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput,
                                      ScoringOutput, ScoringRequestOutput)
from nanovllm.pooling_params import PoolingParams
from nanovllm.sampling_params import SamplingParams
from nanovllm.version import __version__

__all__ = ["LLM", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput", "TextPrompt",
           "TokensPrompt", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "LoRARequest",
           "PoolingParams", "PoolerConfig", "PoolingOutput", "PoolingRequestOutput", "EmbeddingOutput",
           "EmbeddingRequestOutput", "ClassificationOutput", "ClassificationRequestOutput", "ScoringOutput",
           "ScoringRequestOutput", "__version__"]
