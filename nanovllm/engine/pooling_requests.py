"""Pooling requests in: a caller's prompts and PoolingParams checked (all before any is queued, errors
naming the prompt's or the params' index) and turned into prompt-only Sequences; and their outputs."""
from nanovllm.engine.requests import RequestBuilder
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.pooler import TOKEN_WISE, SequencePooling
from nanovllm.outputs import PoolingOutput, PoolingRequestOutput
from nanovllm.pooler_config import PoolingSpec, check_dimensions
from nanovllm.pooling_params import POOLING_TASKS, PoolingParams

_NO_TASK = ("pooling_task is required for LLM.encode: use LLM.embed (pooling_task='embed'), LLM.classify "
            "('classify'), LLM.score, LLM.reward ('token_classify'), or pooling_task='token_embed' for "
            "per-token embeddings")


def check_pooling_runner(spec: PoolingSpec | None, what: str):
    if spec is None:
        raise ValueError(f"{what} is only supported for pooling models; this LLM runs the generate runner: "
                         "create it with LLM(model, runner='pooling') (and convert='embed' or 'classify')")


def check_pooling_api(spec: PoolingSpec | None, task: str, what: str):
    """LLM.embed / LLM.classify: the runner is pooling and the model serves the task (vLLM's words)."""
    check_pooling_runner(spec, what)
    if task not in spec.tasks:
        name = {"embed": "Embedding", "classify": "Classification"}.get(task, task)
        raise ValueError(f"{name} API is not supported by this model (convert={spec.convert!r}, tasks "
                         f"{list(spec.tasks)}): try converting the model with LLM(..., convert={task!r})")


def pooling_seqs(requests: RequestBuilder, spec: PoolingSpec | None, prompts: list, pooling_params,
                 task: str | None, lora_request=None, what: str = "LLM.encode()") -> list[Sequence]:
    """One prompt-only Sequence per prompt, for `task`, every value checked first."""
    check_pooling_runner(spec, what)
    if task is None:
        raise ValueError(_NO_TASK)
    if task not in POOLING_TASKS:
        raise ValueError(f"pooling_task must be one of {POOLING_TASKS}, got {task!r}")
    spec.check_task(task)
    params = [resolve_params(p, i, spec, task, requests.config.hf_config.hidden_size)
              for i, p in enumerate(pooling_params_list(pooling_params, len(prompts)))]
    loras = requests.lora_list(lora_request, len(prompts))
    ids = [requests.token_ids(prompt, i, p.truncate_prompt_tokens)
           for i, (prompt, p) in enumerate(zip(prompts, params))]
    method = "ALL" if task in TOKEN_WISE else spec.pooling_type
    return [Sequence(t, lora_request=lora, pooling=SequencePooling(p, method))
            for t, p, lora in zip(ids, params, loras)]


def pooling_params_list(pooling_params, n: int) -> list[PoolingParams]:
    if pooling_params is None:
        return [PoolingParams()] * n
    if isinstance(pooling_params, PoolingParams):
        return [pooling_params] * n
    if not isinstance(pooling_params, (list, tuple)):
        raise TypeError(f"pooling_params must be a PoolingParams or a list of them, "
                        f"got {type(pooling_params).__name__}")
    bad = next((i for i, p in enumerate(pooling_params) if not isinstance(p, PoolingParams)), None)
    if bad is not None:
        raise TypeError(f"pooling_params {bad} is {type(pooling_params[bad]).__name__}, not PoolingParams")
    if len(pooling_params) != n:
        raise ValueError(f"got {len(pooling_params)} PoolingParams for {n} prompts; give one, "
                         "or one per prompt")
    return list(pooling_params)


def resolve_params(params: PoolingParams, index: int, spec: PoolingSpec, task: str,
                   hidden_size: int) -> PoolingParams:
    try:
        p = params.resolved(task, spec.defaults)
        if p.dimensions is not None:
            check_dimensions(spec, p.dimensions)
            if p.dimensions > hidden_size:
                raise ValueError(f"dimensions={p.dimensions} is more than the model's {hidden_size}")
    except (ValueError, TypeError) as e:
        raise type(e)(f"pooling_params {index}: {e}") from None
    return p


def pooling_output(seq: Sequence) -> PoolingRequestOutput:
    return PoolingRequestOutput(str(seq.seq_id), PoolingOutput(seq.pooling.data), seq.prompt_token_ids,
                                seq.num_cached_tokens or 0)
