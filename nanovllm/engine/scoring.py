"""LLM.score on an engine's encode: a classifier of one label (a cross-encoder, e.g. a reranker)
reads each (query, document) pair as one prompt; an embedding model (a bi-encoder) scores the cosine
similarity of the two embeddings."""
import torch.nn.functional as F

from nanovllm.engine.requests import unwrap_prompt_dict
from nanovllm.engine.pooling_requests import check_pooling_runner
from nanovllm.outputs import PoolingOutput, PoolingRequestOutput, ScoringRequestOutput
from nanovllm.pooling_params import PoolingParams


def score(engine, data_1, data_2, *, use_tqdm=True, pooling_params: PoolingParams | None = None,
          lora_request=None, chat_template: str | None = None) -> list[ScoringRequestOutput]:
    """LLM.score on an engine (the server calls it too)."""
    spec = engine.config.pooling
    check_pooling_runner(spec, "LLM.score()")
    if "score" not in spec.tasks:
        raise ValueError(f"Score API is not supported by this model (convert={spec.convert!r}, tasks "
                         f"{list(spec.tasks)}): it needs an embedding model or a classifier of one label "
                         "(num_labels=1)")
    if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
        raise TypeError(f"pooling_params must be one PoolingParams or None, "
                        f"got {type(pooling_params).__name__}")
    if chat_template is not None:
        raise ValueError("chat_template (a score template): nanovllm takes the pairs as given; format the "
                         "query and document yourself and pass chat_template=None")
    first, second = score_inputs(data_1, data_2)
    if spec.convert == "classify":
        prompts = [pair_prompt(engine.tokenizer, q, d) for q, d in zip(first, second)]
        outs = engine.encode(prompts, pooling_params, use_tqdm, lora_request, "classify")
    else:
        outs = cosine_scores(engine, first, second, pooling_params, use_tqdm, lora_request)
    return [ScoringRequestOutput.from_base(o) for o in outs]


def score_inputs(data_1, data_2) -> tuple[list, list]:
    """vLLM's pairing: 1:1, 1:N (the first paired with each of the second) or N:N."""
    first, second = _as_list(data_1, "data_1"), _as_list(data_2, "data_2")
    if not first or not second:
        raise ValueError("score needs at least one input on each side (data_1 and data_2)")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(f"score inputs pair 1:1, 1:N or N:N; got {len(first)} and {len(second)}")
    return first, second


def _as_list(data, name: str) -> list:
    one_ids = isinstance(data, (list, tuple)) and data and isinstance(data[0], int)
    if isinstance(data, (str, dict)) or one_ids:
        return [data]
    if not isinstance(data, (list, tuple)):
        raise TypeError(f"{name} must be a prompt (text, token ids or a prompt dict) or a list of them, "
                        f"got {type(data).__name__}")
    return list(data)


def pair_prompt(tokenizer, query, document) -> list[int]:
    """One cross-encoder prompt: the tokenizer's pair encoding of two texts (as vLLM builds it, with
    the special tokens its template puts between them), or two token-id lists one after the other."""
    query, document = unwrap_prompt_dict(query, "data_1"), unwrap_prompt_dict(document, "data_2")
    if isinstance(query, str) and isinstance(document, str):
        if tokenizer is None:
            raise ValueError("text inputs to score need a tokenizer, and the engine has none")
        return list(tokenizer(text=query, text_pair=document)["input_ids"])
    if isinstance(query, (list, tuple)) and isinstance(document, (list, tuple)):
        return list(query) + list(document)
    raise TypeError("a score pair is two texts or two token-id lists")


def cosine_scores(engine, first: list, second: list, pooling_params, use_tqdm,
                  lora_request) -> list[PoolingRequestOutput]:
    """Bi-encoder scores: the cosine similarity of each pair's embeddings (each text embedded once)."""
    unique = {}   # a 1:N query is embedded once
    for prompt in first + second:
        unique.setdefault(_key(prompt), prompt)
    keys = list(unique)
    embedded = dict(zip(keys, engine.encode([unique[k] for k in keys], pooling_params, use_tqdm,
                                            lora_request, "embed")))
    pad = getattr(engine.tokenizer, "pad_token_id", None) if engine.tokenizer is not None else None
    outs = []
    for q, d in zip(first, second):
        a, b = embedded[_key(q)], embedded[_key(d)]
        similarity = F.cosine_similarity(a.outputs.data.float(), b.outputs.data.float(), dim=0)
        ids = a.prompt_token_ids + ([pad] if pad is not None else []) + b.prompt_token_ids
        outs.append(PoolingRequestOutput(f"{a.request_id}_{b.request_id}", PoolingOutput(similarity), ids,
                                         a.num_cached_tokens + b.num_cached_tokens))
    return outs


def _key(prompt) -> tuple:
    return type(prompt).__name__, repr(prompt)
