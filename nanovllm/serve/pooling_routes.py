"""The pooling endpoints, in vLLM's shapes: /v1/embeddings (OpenAI's embeddings API), /score and
/v1/score, /rerank and /v1/rerank (Jina's and Cohere's rerank API). Each request is one offline call
of the engine (LLM.embed / LLM.score), run on the engine's thread (EngineLoop.call); bad requests
are ValueErrors, which the app answers with a 400."""
import base64

import torch
from fastapi import FastAPI
from pydantic import Field

from nanovllm.pooling_params import PoolingParams
from nanovllm.serve import protocol as api


class EmbeddingRequest(api._Body):
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"          # "float" or "base64" (little-endian float32, the openai client's)
    dimensions: int | None = None           # Matryoshka models only
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None           # vLLM's extra

    def prompts(self) -> list:
        data = self.input
        if isinstance(data, str) or (data and isinstance(data[0], int)):
            data = [data]
        if not data:
            raise ValueError("input must not be empty")
        return list(data)

    def params(self) -> PoolingParams:
        if self.encoding_format not in ("float", "base64"):
            raise ValueError(f"encoding_format must be 'float' or 'base64', got {self.encoding_format!r}")
        return PoolingParams(dimensions=self.dimensions, normalize=self.normalize,
                             truncate_prompt_tokens=self.truncate_prompt_tokens)


class _ScoreParams(api._Body):
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None

    def params(self) -> PoolingParams:
        return PoolingParams(truncate_prompt_tokens=self.truncate_prompt_tokens,
                             use_activation=self.use_activation)


class ScoreRequest(_ScoreParams):
    # vLLM's names, and its older text_1 / text_2
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None

    def pairs(self) -> tuple:
        first = self.queries if self.queries is not None else self.text_1
        second = self.documents if self.documents is not None else self.text_2
        if first is None or second is None:
            raise ValueError("a score request needs 'queries' and 'documents' (or 'text_1' and 'text_2')")
        return first, second


class RerankRequest(_ScoreParams):
    query: str
    documents: list[str]
    top_n: int | None = Field(default=None, ge=0)   # None or 0: every document
    return_documents: bool = True


def add_pooling_routes(app: FastAPI, engine, model_name: str, check_model):
    """The routes, for the app's engine (an LLM); check_model: the app's (an unknown model is a 404)."""

    async def run(fn):
        return await app.state.loop.call(fn)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest):
        lora = check_model(body.model)
        prompts, params = body.prompts(), body.params()
        outs = await run(lambda llm: llm.embed(prompts, pooling_params=params, use_tqdm=False,
                                               lora_request=lora))
        data = [{"object": "embedding", "index": i,
                 "embedding": encode_vector(o.outputs.embedding, body.encoding_format)}
                for i, o in enumerate(outs)]
        return {"id": api.new_id("embd"), "object": "list", "created": api.now(),
                "model": body.model or model_name, "data": data, "usage": usage(outs)}

    async def score_pairs(body: _ScoreParams, first, second, lora):
        params = body.params()
        return await run(lambda llm: llm.score(first, second, pooling_params=params, use_tqdm=False,
                                               lora_request=lora))

    @app.post("/score")
    @app.post("/v1/score")
    async def score(body: ScoreRequest):
        lora = check_model(body.model)
        outs = await score_pairs(body, *body.pairs(), lora)
        data = [{"index": i, "object": "score", "score": o.outputs.score} for i, o in enumerate(outs)]
        return {"id": api.new_id("score"), "object": "list", "created": api.now(),
                "model": body.model or model_name, "data": data, "usage": usage(outs)}

    @app.post("/rerank")
    @app.post("/v1/rerank")
    async def rerank(body: RerankRequest):
        lora = check_model(body.model)
        if not body.documents:
            raise ValueError("documents must not be empty")
        outs = await score_pairs(body, body.query, body.documents, lora)
        ranked = sorted(range(len(outs)), key=lambda i: -outs[i].outputs.score)[:body.top_n or None]
        results = [{"index": i, "relevance_score": outs[i].outputs.score,
                    **({"document": {"text": body.documents[i]}} if body.return_documents else {})}
                   for i in ranked]
        return {"id": api.new_id("rerank"), "model": body.model or model_name,
                "usage": {"total_tokens": usage(outs)["total_tokens"]}, "results": results}


def encode_vector(values: list[float], encoding_format: str):
    if encoding_format == "float":
        return values
    little_endian = torch.tensor(values, dtype=torch.float32).numpy().astype("<f4")
    return base64.b64encode(little_endian.tobytes()).decode()


def usage(outs) -> dict:
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    return {"prompt_tokens": tokens, "total_tokens": tokens}
