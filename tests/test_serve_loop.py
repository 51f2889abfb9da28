"""The server's engine loop without HTTP or a model: a failing engine fails its requests with a
500, never hangs them, and the server says it is unhealthy."""

import asyncio
import importlib.util
import json
import socket
import threading
import time
import types
import urllib.error
import urllib.request

import pytest

if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None:
    pytest.skip("needs fastapi and uvicorn (pip install 'nanovllm[test]')", allow_module_level=True)

import uvicorn  # noqa: E402

from nanovllm.engine.sequence import Sequence, SequenceStatus  # noqa: E402
from nanovllm.outputs import CompletionOutput  # noqa: E402
from nanovllm.sampling_params import SamplingParams  # noqa: E402
from nanovllm.serve.app import create_app  # noqa: E402
from nanovllm.serve.engine_loop import EngineError, EngineLoop, Request  # noqa: E402


class BrokenEngine:
    """Accepts requests; its first step raises, as a dead device would."""

    tokenizer = None
    default_sampling_overrides = {}
    config = types.SimpleNamespace(max_model_len=4096)

    def __init__(self):
        self.queued = []

    def is_finished(self):
        return not self.queued

    def add_request(self, prompt, params, prompt_index=0):
        if not prompt:
            raise ValueError(f"prompt {prompt_index} is empty")
        seqs = [Sequence(prompt, params)]
        self.queued += seqs
        return seqs

    def step(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def abort(self, seqs):
        pass


def test_an_engine_failure_fails_the_request_and_the_loop_reports_it():
    async def main():
        loop = EngineLoop(BrokenEngine(), asyncio.get_running_loop())
        with pytest.raises(ValueError, match="empty"):  # a bad request: the loop goes on
            await loop.add([Request([], SamplingParams())])
        request = Request([1, 2, 3], SamplingParams())
        await loop.add([request])
        update = await asyncio.wait_for(request.updates.get(), 10)
        assert isinstance(update, EngineError) and "illegal memory access" in str(update)
        assert not loop.healthy
        with pytest.raises(EngineError):
            await loop.add([Request([1], SamplingParams())])
        loop.stop()

    asyncio.run(main())


def _serve_in_thread(app) -> tuple[uvicorn.Server, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{port}"


def _status(url: str, body: dict | None = None) -> tuple[int, dict | None]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def _serve_fake(engine, name: str) -> tuple[uvicorn.Server, str]:
    """create_app over a fake engine, given the config fields the app reads, served in a thread."""
    class Config:
        model, max_model_len, max_logprobs = name, 64, 20

    engine.config = Config
    return _serve_in_thread(create_app(engine, name))


def test_http_500_and_unhealthy_after_an_engine_failure():
    server, base = _serve_fake(BrokenEngine(), "broken")
    try:
        assert _status(base + "/health")[0] == 200
        status, body = _status(base + "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2})
        assert status == 500 and "illegal memory access" in body["error"]["message"]
        assert _status(base + "/health")[0] == 503
    finally:
        server.should_exit = True


def test_a_missing_extra_is_a_bad_request_and_the_loop_goes_on():
    class NoXgrammarEngine(BrokenEngine):
        def add_request(self, prompt, params, prompt_index=0):
            if prompt == [9]:
                raise ImportError("structured outputs need xgrammar: pip install 'nanovllm[structured]'")
            return super().add_request(prompt, params, prompt_index)

    async def main():
        loop = EngineLoop(NoXgrammarEngine(), asyncio.get_running_loop())
        with pytest.raises(ValueError, match=r"nanovllm\[structured\]"):
            await loop.add([Request([9], SamplingParams())])
        assert loop.healthy
        loop.stop()

    asyncio.run(main())


class CountingEngine(BrokenEngine):
    """One token per running sequence per step, finishing at max_tokens."""

    def step(self):
        for seq in self.queued:
            seq.append_token(7)
            if seq.num_completion_tokens == seq.sampling_params.max_tokens:
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "length"
        self.queued = [s for s in self.queued if not s.is_finished]

    def completion_output(self, seq):
        return CompletionOutput(seq.index, "", seq.completion_token_ids, finish_reason=seq.finish_reason)


@pytest.mark.parametrize("interval", [1, 4])
def test_every_token_arrives_once_whatever_the_stream_interval(interval):
    async def main():
        loop = EngineLoop(CountingEngine(), asyncio.get_running_loop(), stream_interval=interval)
        request = Request([1, 2, 3], SamplingParams(max_tokens=10))
        await loop.add([request])
        updates = []
        while not updates or updates[-1].output is None:
            updates.append(await asyncio.wait_for(request.updates.get(), 10))
        loop.stop()
        return updates

    updates = asyncio.run(main())
    assert [t for u in updates for t in u.token_ids] == [7] * 10
    # The first token goes out at once, then every `interval` tokens, the rest with the output.
    assert [len(u.token_ids) for u in updates] == ([1] * 10 if interval == 1 else [1, 4, 4, 1])
    assert updates[-1].output.finish_reason == "length"


class SlowEngine(CountingEngine):
    """CountingEngine whose steps take a while; records the step count at which each prompt and
    each abort arrived."""

    def __init__(self):
        super().__init__()
        self.steps, self.added_at, self.aborted = 0, [], []

    def add_request(self, prompt, params, prompt_index=0):
        self.added_at.append(self.steps)
        return super().add_request(prompt, params, prompt_index)

    def step(self):
        time.sleep(0.02)
        self.steps += 1
        super().step()

    def abort(self, seqs):
        self.aborted += seqs
        self.queued = [s for s in self.queued if s not in seqs]


def test_the_prompts_of_one_request_enter_the_engine_together_or_not_at_all():
    # a multi-prompt completion is one batch for the engine (not one prompt a step), and a bad
    # prompt refuses the whole request, naming that prompt
    async def main():
        engine = SlowEngine()
        loop = EngineLoop(engine, asyncio.get_running_loop())
        await loop.add([Request([1], SamplingParams(max_tokens=50))])   # keeps the engine stepping
        await asyncio.sleep(0.1)
        batch = [Request([2, 3], SamplingParams(max_tokens=2)) for _ in range(4)]
        await loop.add(batch)
        assert len(set(engine.added_at[1:])) == 1 and engine.added_at[1] > 0
        for request in batch:
            while (await asyncio.wait_for(request.updates.get(), 10)).output is None:
                pass
        good = [Request([4], SamplingParams(max_tokens=2)) for _ in range(2)]
        with pytest.raises(ValueError, match="prompt 2 is empty"):
            await loop.add(good + [Request([], SamplingParams())])
        assert engine.aborted == [seq for r in good for seq in r.seqs] and len(engine.aborted) == 2
        assert loop.healthy
        loop.stop()

    asyncio.run(main())


def test_a_request_added_as_the_engine_dies_is_refused_not_left_waiting():
    # the engine thread fails between add's health check and its command reaching the queue: the
    # failure's clean-up has already emptied the queue, so add must answer the request itself
    class Racing(EngineLoop):
        checks = 0

        @property
        def healthy(self):
            self.checks += 1
            return self.checks == 1 or super().healthy   # the first check passes, as if just before

    async def main():
        loop = Racing(BrokenEngine(), asyncio.get_running_loop())
        loop.stop()   # the thread is gone: nothing will read the queue again
        with pytest.raises(EngineError, match="not running"):
            await asyncio.wait_for(loop.add([Request([1], SamplingParams())]), 5)

    asyncio.run(main())


def test_an_engine_failure_while_adding_a_batch_fails_that_request_too():
    # not a bad request (ValueError) but a broken engine: the add being applied is answered, and
    # the loop reports the failure, instead of leaving the request waiting
    class FailsOnSecond(BrokenEngine):
        def add_request(self, prompt, params, prompt_index=0):
            if prompt_index == 1:
                raise RuntimeError("this engine can no longer run: ranks out of step")
            return super().add_request(prompt, params, prompt_index)

    async def main():
        loop = EngineLoop(FailsOnSecond(), asyncio.get_running_loop())
        with pytest.raises(EngineError, match="out of step"):
            batch = [Request([1], SamplingParams()), Request([2], SamplingParams())]
            await asyncio.wait_for(loop.add(batch), 5)
        await asyncio.sleep(0.1)
        assert not loop.healthy
        loop.stop()

    asyncio.run(main())


def test_without_a_tokenizer_echo_and_logprobs_are_bad_requests():
    server, base = _serve_fake(CountingEngine(), "ids-only")
    try:
        for extra in ({"echo": True}, {"logprobs": 1}):
            status, body = _status(base + "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2, **extra})
            assert status == 400 and "tokenizer" in body["error"]["message"], (extra, status, body)
        assert _status(base + "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2})[0] == 200
    finally:
        server.should_exit = True


def test_an_empty_stream_options_without_stream_is_accepted_as_vllm_accepts_it():
    from nanovllm.serve.protocol import CompletionRequest
    assert CompletionRequest(prompt="hi", stream_options={}).completion_params({}).max_tokens == 16
    with pytest.raises(ValueError, match="stream=true"):
        CompletionRequest(prompt="hi", stream_options={"include_usage": True}).completion_params({})


def test_stopping_the_loop_answers_and_aborts_what_it_accepted():
    # the server shutting down with a stream open: the request gets an error, not silence, and its
    # sequences are aborted (their blocks freed)
    async def main():
        engine = SlowEngine()
        loop = EngineLoop(engine, asyncio.get_running_loop())
        request = Request([1, 2], SamplingParams(max_tokens=3000))
        await loop.add([request])
        await asyncio.wait_for(request.updates.get(), 10)   # it is running
        loop.stop()
        while not isinstance(update := await asyncio.wait_for(request.updates.get(), 10), Exception):
            pass
        assert isinstance(update, EngineError) and "shutting down" in str(update)
        assert engine.aborted == request.seqs
        with pytest.raises(EngineError, match="shutting down"):
            await loop.add([Request([1], SamplingParams())])

    asyncio.run(main())


def test_max_tokens_past_the_context_is_refused_as_vllm_s_server_does():
    async def main():
        engine = SlowEngine()
        engine.config = types.SimpleNamespace(max_model_len=10)
        loop = EngineLoop(engine, asyncio.get_running_loop())
        fits = Request([1, 2, 3], SamplingParams(max_tokens=7))
        await loop.add([fits])   # 3 + 7 = 10 fits
        with pytest.raises(ValueError, match=r"prompt 1: 'max_tokens' .* too large: 8.*\(8 > 10 - 3\)"):
            await loop.add([Request([1, 2, 3], SamplingParams(max_tokens=2)),
                            Request([1, 2, 3], SamplingParams(max_tokens=8))])
        assert len(engine.aborted) == 2 and loop.healthy   # all or none
        loop.stop()

    asyncio.run(main())


def test_an_api_key_guards_the_v1_routes_only():
    engine = BrokenEngine()
    engine.config = types.SimpleNamespace(model="m", max_model_len=64)
    server, base = _serve_in_thread(create_app(engine, "m", api_key="sesame"))
    try:
        assert _status(base + "/health")[0] == 200
        status, body = _status(base + "/v1/models")
        assert status == 401 and "Authorization: Bearer" in body["error"]["message"]
        request = urllib.request.Request(base + "/v1/models", headers={"Authorization": "Bearer sesame"})
        with urllib.request.urlopen(request, timeout=30) as r:
            assert json.loads(r.read())["data"][0]["id"] == "m"
        wrong = urllib.request.Request(base + "/v1/models", headers={"Authorization": "Bearer open"})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(wrong, timeout=30)
        assert info.value.code == 401
    finally:
        server.should_exit = True


def test_with_an_api_key_a_plain_request_whose_client_left_is_still_aborted():
    # the key check must not hide the client's disconnect from the handler (a wrapping middleware did)
    engine = SlowEngine()
    engine.config = types.SimpleNamespace(model="m", max_model_len=4096, max_logprobs=20)
    server, base = _serve_in_thread(create_app(engine, "m", api_key="sesame"))
    try:
        body = json.dumps({"prompt": [1, 2], "max_tokens": 3000}).encode()
        request = urllib.request.Request(base + "/v1/completions", body, {
            "Content-Type": "application/json", "Authorization": "Bearer sesame"})
        with pytest.raises(OSError):   # the client gives up after a second
            urllib.request.urlopen(request, timeout=1)
        deadline = time.monotonic() + 10
        while not engine.aborted and time.monotonic() < deadline:
            time.sleep(0.1)
        assert engine.aborted and engine.steps < 1000   # aborted, long before its 3000 tokens
    finally:
        server.should_exit = True
