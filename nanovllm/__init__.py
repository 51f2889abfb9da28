from nanovllm.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from nanovllm.engine.arg_utils import EngineArgs
from nanovllm.inputs import TextPrompt, TokensPrompt
from nanovllm.llm import LLM
from nanovllm.logger import configure_logger
from nanovllm.lora.request import LoRARequest
from nanovllm.outputs import (ClassificationOutput, ClassificationRequestOutput, CompletionOutput,
                              EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput,
                              RequestOutput, ScoringOutput, ScoringRequestOutput)
from nanovllm.pooler_config import PoolerConfig
from nanovllm.pooling_params import PoolingParams
from nanovllm.sampling_params import SamplingParams
from nanovllm.version import __version__

configure_logger()   # INFO lines on stderr, as vLLM's (NANOVLLM_LOGGING_LEVEL, NANOVLLM_CONFIGURE_LOGGING)

__all__ = ["LLM", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput", "TextPrompt",
           "TokensPrompt", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "LoRARequest",
           "PoolingParams", "PoolerConfig", "PoolingOutput", "PoolingRequestOutput", "EmbeddingOutput",
           "EmbeddingRequestOutput", "ClassificationOutput", "ClassificationRequestOutput", "ScoringOutput",
           "ScoringRequestOutput", "__version__"]
