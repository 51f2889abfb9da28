"""The pooling endpoints of a real server process (python -m nanovllm.serve) on tiny random models on
the CPU: /v1/embeddings through the official openai client, /score, /rerank and /v1/rerank in vLLM's
shapes, each equal to the offline LLM's results; bad requests are 400s."""
import importlib.util
import json
import urllib.error
import urllib.request

import pytest

for _module in ("fastapi", "uvicorn", "openai"):
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"the server tests need {_module} (pip install 'nanovllm[test]')",
                    allow_module_level=True)

import openai  # noqa: E402

from conftest import make_model, serve_process  # noqa: E402
from nanovllm import LLM, PoolingParams  # noqa: E402

ENGINE = dict(device="cpu", kvcache_block_size=8, num_kvcache_blocks=64, max_num_batched_tokens=16,
              runner="pooling")
RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["w5", "w7"],
            "is_original_qwen3_reranker": True}
TEXTS = ["w10 w11 w12", "w20 " * 30, "w40 w41"]   # the second runs in chunks
START_TIMEOUT_S = 180


def _flags(options: dict) -> list[str]:
    return [f"--{k.replace('_', '-')}={json.dumps(v) if isinstance(v, dict) else v}"
            for k, v in options.items()]


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_model(str(tmp_path_factory.mktemp("qwen3")), "qwen3")


@pytest.fixture(scope="module")
def embed_server(model_dir, tmp_path_factory):
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w+")
    yield from serve_process([model_dir, "--served-model-name", "emb", *_flags(ENGINE)], log, START_TIMEOUT_S)


@pytest.fixture(scope="module")
def rerank_server(model_dir, tmp_path_factory):
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w+")
    flags = _flags({**ENGINE, "hf_overrides": RERANKER})
    yield from serve_process([model_dir, "--served-model-name", "rr", *flags], log, START_TIMEOUT_S)


def _offline(model_dir, **options):
    return LLM(model_dir, **{k: v for k, v in ENGINE.items() if k != "device"}, **options)


def test_embeddings_through_the_openai_client(embed_server, model_dir):
    client = openai.OpenAI(base_url=embed_server + "/v1", api_key="none", max_retries=0, timeout=120)
    got = client.embeddings.create(model="emb", input=TEXTS)   # the client asks for base64 and decodes it
    floats = client.embeddings.create(model="emb", input=TEXTS[0], encoding_format="float")
    llm = _offline(model_dir)
    try:
        want = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
        unnormalized = llm.embed(TEXTS[:1], pooling_params=PoolingParams(normalize=False), use_tqdm=False)
    finally:
        llm.shutdown()
    assert [d.index for d in got.data] == [0, 1, 2] and got.model == "emb"
    for d, w in zip(got.data, want):
        assert d.embedding == pytest.approx(w, abs=1e-6)
    assert floats.data[0].embedding == pytest.approx(want[0], abs=1e-6)
    assert got.usage.prompt_tokens == sum(len(t.split()) for t in TEXTS)
    status, body = _post(embed_server + "/v1/embeddings", {"input": [[10, 11, 12]], "normalize": False})
    assert status == 200 and body["data"][0]["embedding"] == pytest.approx(unnormalized[0].outputs.embedding,
                                                                          abs=1e-6)


def test_bad_embedding_requests_are_400(embed_server):
    client = openai.OpenAI(base_url=embed_server + "/v1", api_key="none", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError, match="Matryoshka"):
        client.embeddings.create(model="emb", input="w5 w6", dimensions=16)
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        client.embeddings.create(model="emb", input=[[9999]])
    with pytest.raises(openai.BadRequestError, match="only supported for generative models"):
        client.completions.create(model="emb", prompt="w5 w6", max_tokens=2)
    for body in ({"input": []}, {"input": "w5", "encoding_format": "int8"}, {"nothing": 1}):
        status, reply = _post(embed_server + "/v1/embeddings", body)
        assert status == 400 and reply["error"]["type"] == "BadRequestError", reply
    status, reply = _post(embed_server + "/rerank", {"query": "w5", "documents": ["w6"]})
    assert status == 200   # an embedding model scores by cosine similarity (a bi-encoder)


def test_score_and_rerank_in_vllms_shapes(rerank_server, model_dir):
    llm = _offline(model_dir, hf_overrides=RERANKER)
    try:
        want = [o.outputs.score for o in llm.score(TEXTS[0], TEXTS, use_tqdm=False)]
    finally:
        llm.shutdown()
    status, body = _post(rerank_server + "/score", {"model": "rr", "queries": TEXTS[0], "documents": TEXTS})
    assert status == 200 and body["object"] == "list"
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-6)
    status, old = _post(rerank_server + "/v1/score", {"text_1": TEXTS[0], "text_2": TEXTS})
    assert status == 200 and [d["score"] for d in old["data"]] == pytest.approx(want, abs=1e-6)
    for route in ("/rerank", "/v1/rerank"):
        status, body = _post(rerank_server + route, {"model": "rr", "query": TEXTS[0], "documents": TEXTS,
                                                     "top_n": 2})
        order = sorted(range(3), key=lambda i: -want[i])[:2]
        assert status == 200 and [r["index"] for r in body["results"]] == order
        scores = [r["relevance_score"] for r in body["results"]]
        assert scores == pytest.approx([want[i] for i in order], abs=1e-6)
        assert body["results"][0]["document"] == {"text": TEXTS[order[0]]}
        assert body["usage"]["total_tokens"] > 0
    for route, bad in (("/score", {"queries": ["w5", "w6"], "documents": ["w7", "w8", "w9"]}),
                       ("/score", {"queries": "w5"}),
                       ("/rerank", {"query": "w5", "documents": []}),
                       ("/rerank", {"query": "w5", "documents": ["w6"], "top_n": -1})):
        status, reply = _post(rerank_server + route, bad)
        assert status == 400 and reply["error"]["type"] == "BadRequestError", (route, reply)
    status, reply = _post(rerank_server + "/v1/embeddings", {"input": "w5"})
    assert status == 400 and "Embedding API is not supported" in reply["error"]["message"]
    status, reply = _post(rerank_server + "/score", {"model": "other", "queries": "w5", "documents": "w6"})
    assert status == 404
