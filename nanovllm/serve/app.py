"""The HTTP routes. Each handler turns its body into engine requests, hands them to the EngineLoop
and turns the updates that come back into a response or a stream of server-sent events."""

import asyncio
import gc
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from http import HTTPStatus

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from nanovllm.chat_utils import render_chat
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.requests import encode_text, past_max_logprobs
from nanovllm.serve import protocol as api
from nanovllm.serve.engine_loop import EngineError, EngineLoop, Request, Update
from nanovllm.serve.pooling_routes import add_pooling_routes
from nanovllm.serve.tools import ToolChoice
from nanovllm.version import __version__

logger = logging.getLogger(__name__)

POLL_DISCONNECT_S = 0.5  # how often a non-streaming request checks that its client is still there


class ModelNotFound(Exception):
    pass


class ClientGone(Exception):
    """The client of a plain (not streamed) request went away; its sequences were aborted."""


def create_app(engine, model_name: str, stream_interval: int = 1, *, api_key: str | None = None,
               cors: dict | None = None, tool_call_parser: str | None = None,
               lora_modules: list | None = None) -> FastAPI:
    """stream_interval: see EngineLoop (1: every token is streamed as the engine makes it).
    tool_call_parser: how "auto" tool choice reads calls back (tools.PARSERS; None: "auto" is a 400).
    api_key: when set, /v1 routes need "Authorization: Bearer <api_key>" (a 401 otherwise), as
    vLLM's --api-key. cors: CORSMiddleware's options (default: any origin, method and header,
    no credentials, as vLLM's defaults). lora_modules: LoRARequests served beside the base model, a
    request naming one's lora_name as its model runs under that adapter (vLLM's --lora-modules)."""
    adapters = {r.lora_name: r for r in lora_modules or ()}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # The model, torch and the tokenizer are hundreds of thousands of long-lived objects: keep
        # the collector from walking them again and again while it serves (as vLLM does).
        gc.collect()
        gc.freeze()
        app.state.loop = EngineLoop(engine, asyncio.get_running_loop(), stream_interval)
        try:
            yield
        finally:
            app.state.loop.stop()
            gc.unfreeze()   # so that shutting the engine down can collect the model

    app = FastAPI(title="nanovllm", lifespan=lifespan)
    app.add_middleware(CORSMiddleware, **{"allow_origins": ["*"], "allow_methods": ["*"],
                                          "allow_headers": ["*"], **(cors or {})})
    tokenizer = engine.tokenizer

    if api_key:
        app.add_middleware(_ApiKey, api_key=api_key)

    def check_model(name: str | None):
        """The request's LoRARequest (None: the base model). No name or an empty one: the served
        model, as vLLM takes it."""
        if name and name != model_name and name not in adapters:
            served = ", ".join(f"`{n}`" for n in [model_name, *adapters])
            raise ModelNotFound(f"The model `{name}` does not exist; this server serves {served}.")
        return adapters.get(name) if name else None

    def start(body):
        lora = check_model(body.model)
        if ignored := body.ignored_fields():   # as vLLM, which logs them too
            logger.warning("The following fields were present in the request but ignored: %s", ignored)
        return lora

    @app.exception_handler(RequestValidationError)
    async def bad_body(raw: HTTPRequest, exc: RequestValidationError):
        content_type = raw.headers.get("content-type", "")
        details = "; ".join(api.json_error_message(e, content_type) for e in exc.errors())
        return JSONResponse(api.error_body(details, "BadRequestError", 400), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(raw: HTTPRequest, exc: HTTPException):
        # Starlette's own errors, in OpenAI's shape as every other error here: a body that is not
        # even text (400), an unknown route (404), a wrong method (405, with its Allow header).
        # The type is the status's phrase, as vLLM's handler writes it.
        if exc.status_code == 400:
            message = f"{exc.detail}: send a JSON object encoded as UTF-8"
            return JSONResponse(api.error_body(message, "BadRequestError", 400), status_code=400)
        message = f"{exc.detail}: {raw.method} {raw.url.path}"
        if allowed := (exc.headers or {}).get("Allow"):
            message += f" (it takes {allowed})"
        return JSONResponse(api.error_body(message, HTTPStatus(exc.status_code).phrase, exc.status_code),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(ValueError)
    @app.exception_handler(TypeError)
    async def bad_value(_, exc: Exception):
        return JSONResponse(api.error_body(str(exc), "BadRequestError", 400), status_code=400)

    @app.exception_handler(ModelNotFound)
    async def no_model(_, exc: ModelNotFound):  # 404, as vLLM answers an unknown model
        return JSONResponse(api.error_body(str(exc), "NotFoundError", 404, "model"), status_code=404)

    @app.exception_handler(ClientGone)
    async def client_gone(_, exc: ClientGone):  # nobody reads it: an answer, not a server error
        return JSONResponse(api.error_body("the client disconnected", "ClientDisconnected", 499),
                            status_code=499)

    @app.exception_handler(EngineError)
    async def engine_failed(_, exc: EngineError):
        return JSONResponse(api.error_body(str(exc), "InternalServerError", 500), status_code=500)

    @app.get("/health")
    async def health(raw: HTTPRequest):
        return PlainTextResponse("", status_code=200 if raw.app.state.loop.healthy else 503)

    @app.get("/version")
    async def server_version():
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(body: api.TokenizeRequest):
        """vLLM's: a prompt's (or a chat's) token ids, as the endpoints would take them."""
        start(body)
        need_tokenizer()
        if body.messages is not None:   # as vLLM: special tokens added only when asked
            ids = await asyncio.to_thread(chat_prompt, tokenizer, body, bool(body.add_special_tokens))
        else:
            ids = encode_text(tokenizer, body.prompt, "prompt", add_special_tokens=body.add_special_tokens
                              is not False)
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": engine.config.max_model_len, "tokens": ids,
                "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: api.DetokenizeRequest):
        start(body)
        need_tokenizer()
        vocab = engine.config.hf_config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise ValueError(f"tokens must be token ids in [0, {vocab}) (the model's vocabulary)")
        return {"prompt": tokenizer.decode(body.tokens)}

    def need_tokenizer():
        if tokenizer is None:
            raise ValueError("this server has no tokenizer (the model folder has none, or "
                             "--skip-tokenizer-init): send and read token ids")

    @app.get("/v1/models")
    async def models():
        card = {
            "id": model_name,
            "object": "model",
            "created": api.now(),
            "owned_by": "nanovllm",
            "root": engine.config.model,
            "parent": None,
            "max_model_len": engine.config.max_model_len,
        }
        loras = [{**card, "id": name, "root": r.lora_path, "parent": model_name}
                 for name, r in adapters.items()]
        return {"object": "list", "data": [card, *loras]}

    @app.get("/metrics")
    async def metrics():
        """Prometheus text: queue lengths and KV-cache use (read without a lock: a snapshot)."""
        s = engine.scheduler
        blocks = s.block_manager
        used = 1 - blocks.num_free_blocks / blocks.num_blocks
        lines = [
            f"nanovllm:num_requests_running {len(s.running)}",
            f"nanovllm:num_requests_waiting {len(s.waiting)}",
            f"nanovllm:kv_cache_usage_perc {used:.6f}",
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    @app.post("/v1/completions")
    async def completions(body: api.CompletionRequest, raw: HTTPRequest):
        lora = start(body)
        if tokenizer is None and (body.echo or body.logprobs is not None):
            raise ValueError("echo and logprobs need a tokenizer, and this server has none (the model folder "
                             "has none, or --skip-tokenizer-init)")
        params = body.completion_params(engine.default_sampling_overrides)
        check_logprobs(body, params, engine.config.max_logprobs)
        await compile_grammar(engine, params)
        requests = await submit(raw, [(p, params) for p in body.prompts()], lora)
        reply = _Completions(tokenizer, body.model or model_name, body, requests)
        if body.stream:
            return sse(raw, requests, reply)
        return reply.response(await collect(raw, requests))

    @app.post("/v1/chat/completions")
    async def chat(body: api.ChatRequest, raw: HTTPRequest):
        lora = start(body)
        tools = ToolChoice(body.tools, body.tool_choice, tool_call_parser)
        params = body.chat_params(engine.default_sampling_overrides, tools.schema())
        check_logprobs(body, params, engine.config.max_logprobs)
        await compile_grammar(engine, params)
        prompt = await asyncio.to_thread(chat_prompt, tokenizer, body)
        requests = await submit(raw, [(prompt, params)], lora)
        reply = _Chat(tokenizer, body.model or model_name, body, requests, tools)
        if body.stream:
            return sse(raw, requests, reply)
        return reply.response(await collect(raw, requests))

    add_pooling_routes(app, engine, model_name, check_model)   # /v1/embeddings, /score, /rerank
    return app


class _ApiKey:
    """vLLM's --api-key: /v1 routes answer 401 without "Authorization: Bearer <key>". Plain ASGI
    (not an @app.middleware, which wraps the request's receive channel): a handler still sees its
    client disconnect."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = "Unauthorized: give the server's API key as 'Authorization: Bearer <key>'"
                response = JSONResponse(api.error_body(message, "AuthenticationError", 401), status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def chat_prompt(tokenizer, body, add_special_tokens: bool = False) -> list[int]:
    """A chat request's (or a /tokenize request's) messages as the token ids of its template's text
    (add_special_tokens False: the template wrote any BOS)."""
    if "chat_template" in (body.chat_template_kwargs or {}):
        # as vLLM by default: a request may pass variables to the server's template, not its own
        # template (which the server would render)
        raise ValueError("chat_template_kwargs: chat_template may not be given in a request; the "
                         "server renders its model's chat template")
    text = render_chat(
        tokenizer,
        body.messages,
        "messages",
        add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
        continue_final_message=body.continue_final_message,
        tools=body.tools,
        chat_template_kwargs=body.chat_template_kwargs,
    )
    return encode_text(tokenizer, text, "messages", add_special_tokens=add_special_tokens)


def check_logprobs(body, params, cap: int):
    """The engine's max_logprobs check, said in the request's fields and the server's flag."""
    output_field = "top_logprobs" if isinstance(body, api.ChatRequest) else "logprobs"
    prompt_field = "prompt_logprobs" if body.prompt_logprobs is not None else output_field
    for field, k in ((output_field, params.logprobs), (prompt_field, params.prompt_logprobs)):
        if past_max_logprobs(k, cap):
            asked = "-1 (the whole vocabulary)" if k == -1 else k
            raise ValueError(f"{field}={asked} is more than this server allows: ask for at most {cap}, or "
                             "start the server with a larger --max-logprobs")


async def compile_grammar(engine, params):
    """Compile the request's structured-output grammar (or find it cached) in a worker thread, so
    neither the event loop nor the engine's step loop waits for xgrammar. A bad schema, regex or
    grammar, or a server without xgrammar, is a ValueError: a 400."""
    if params.structured_outputs is None:
        return
    try:
        await asyncio.to_thread(engine.compile_grammar, params.structured_outputs)
    except ImportError as e:
        raise ValueError(f"this server cannot serve structured outputs: {e}") from None


async def submit(raw: HTTPRequest, prompts: list[tuple], lora_request=None) -> list[Request]:
    """Queue every prompt of one HTTP request (sharing one update queue), under its adapter's
    LoRARequest (None: the base model); all or nothing."""
    loop: EngineLoop = raw.app.state.loop
    updates: asyncio.Queue = asyncio.Queue()
    requests, base = [], 0
    for prompt, params in prompts:
        requests.append(Request(prompt, params, updates, choice_base=base, lora_request=lora_request))
        base += params.n
    try:
        await loop.add(requests)
    except BaseException:
        for request in requests:
            loop.abort(request)
        raise
    return requests


async def collect(raw: HTTPRequest, requests: list[Request]) -> list[tuple]:
    """Wait for every choice's final output; abort the requests if the client goes away.
    Returns (CompletionOutput, its TokenLogprobs or None) per choice."""
    outputs = [None] * sum(r.params.n for r in requests)
    logprobs = [[] for _ in outputs]  # per choice: TokenLogprobs, as the steps gave them
    updates = requests[0].updates
    checked = time.monotonic()
    try:
        while any(o is None for o in outputs):
            try:
                update = await asyncio.wait_for(updates.get(), POLL_DISCONNECT_S)
            except TimeoutError:
                update = None
            if time.monotonic() - checked >= POLL_DISCONNECT_S:   # also while updates keep coming
                checked = time.monotonic()
                if await raw.is_disconnected():
                    raise ClientGone()
            if update is None:
                continue
            if isinstance(update, Exception):
                raise update
            logprobs[update.index] += update.logprobs or []
            if update.output is not None:
                outputs[update.index] = update.output
    except BaseException:
        for request in requests:
            raw.app.state.loop.abort(request)
        raise
    return [(out, lps if out.logprobs is not None else None) for out, lps in zip(outputs, logprobs)]


def sse(raw: HTTPRequest, requests: list[Request], reply) -> StreamingResponse:
    async def events():
        done = False
        updates = requests[0].updates
        try:
            remaining = sum(r.params.n for r in requests)
            while remaining:
                merged = _drain(await updates.get(), updates)
                if isinstance(merged, Exception):  # the engine failed: say so in the stream
                    yield _event(api.error_body(str(merged), "InternalServerError", 500))
                    break
                remaining -= sum(u.output is not None for u in merged)
                yield "".join(reply.chunk_event(u) for u in merged)
            else:
                if reply.body.include_usage:
                    yield _event(reply.usage_chunk())
            done = True
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # the client went away (the stream was cancelled): free its blocks
                for request in requests:
                    raw.app.state.loop.abort(request)

    return StreamingResponse(events(), media_type="text/event-stream")


def _drain(first, updates: asyncio.Queue) -> list[Update] | Exception:
    """first and every update already queued behind it, merged into one per choice: a stream sends
    one event per choice for all the steps that ran since it last sent, so a busy event loop sends
    fewer, larger events instead of falling behind the engine."""
    merged: dict[int, Update] = {}
    update = first
    while True:
        if isinstance(update, Exception):
            return update
        seen = merged.get(update.index)
        if seen is None:
            merged[update.index] = update
        else:
            seen.token_ids = seen.token_ids + update.token_ids
            if update.logprobs is not None:
                seen.logprobs = (seen.logprobs or []) + update.logprobs
            seen.output = update.output
        if updates.empty():
            return list(merged.values())
        update = updates.get_nowait()


_encode = json.JSONEncoder(ensure_ascii=False).encode  # one encoder, not one per call as json.dumps


def _event(payload: dict) -> str:
    return f"data: {_encode(payload)}\n\n"


class _TextStream:
    """One choice's streamed text. Text that may be the start of a stop string is held back until
    the next tokens show it is not; the final output's text settles the rest."""

    def __init__(self, tokenizer, params, context: list[int]):
        self.tokenizer, self.params = tokenizer, params
        self.detok, self.ids, self.sent = IncrementalDetokenizer(context), [], 0
        self.hold = max(map(len, params.stop)) - 1 if params.stop else 0
        self.num_tokens = 0

    def delta(self, update: Update) -> str:
        self.ids += update.token_ids
        if self.tokenizer is None:  # a model folder without a tokenizer: token ids only
            self.num_tokens = len(self.ids)
            return ""
        if update.output is not None:
            text = update.output.text
            self.num_tokens = len(update.output.token_ids)
            new, self.sent = (text[self.sent :] if len(text) > self.sent else ""), max(self.sent, len(text))
            return new
        self.detok.step(self.tokenizer, self.ids, self.params.skip_special_tokens)
        visible = len(self.detok.text) - self.hold
        new = self.detok.text[self.sent : visible] if visible > self.sent else ""
        self.sent += len(new)
        return new


class _Reply:
    """What both endpoints share: ids, choice streams, usage."""

    object_name = chunk_name = ""

    def __init__(self, tokenizer, model_name: str, body, requests: list[Request]):
        self.tokenizer, self.model, self.body, self.requests = tokenizer, model_name, body, requests
        self.name = api.token_names(tokenizer, body.return_tokens_as_token_ids)   # of logprobs' tokens
        self.id, self.created = api.new_id(self.id_prefix), api.now()
        # (the context: read behind the prompt's last tokens, as the final text is)
        self.streams = [_TextStream(tokenizer, r.params, r.seqs[0].text_context)
                        for r in requests for _ in range(r.params.n)]
        # Every chunk shares its envelope: written once, each event adds only its choice.
        self.chunk_head = "data: " + _encode(self.envelope(self.chunk_name))[:-1] + ',"choices":['

    def chunk_event(self, update: Update) -> str:
        """One server-sent event with this update's choice ("" when it has nothing to say)."""
        choice = self.choice_json(update)
        return f"{self.chunk_head}{choice}]}}\n\n" if choice else ""

    def envelope(self, name: str, **fields) -> dict:
        return {"id": self.id, "object": name, "created": self.created, "model": self.model, **fields}

    def usage(self, outputs=None) -> dict:
        prompt = sum(r.seqs[0].num_prompt_tokens for r in self.requests)
        completion = (
            sum(len(o.token_ids) for o, _ in outputs) if outputs else sum(s.num_tokens for s in self.streams)
        )
        return api.usage(prompt, completion)

    def usage_chunk(self) -> dict:
        return self.envelope(self.chunk_name, choices=[], usage=self.usage())

    def request_of(self, index: int) -> Request:
        return next(r for r in reversed(self.requests) if r.choice_base <= index)

    def prompt_logprobs(self, request: Request) -> list | None:
        """vLLM's prompt_logprobs field, when the request asked for it."""
        if self.body.prompt_logprobs is None:
            return None
        seq = request.seqs[0]
        return api.prompt_logprobs(self.tokenizer, seq.prompt_token_ids, seq.prompt_logprobs)


class _Completions(_Reply):
    id_prefix, object_name, chunk_name = "cmpl", "text_completion", "text_completion"

    def __init__(self, *args):
        super().__init__(*args)
        self.prompt_parts: dict[int, dict] = {}   # by id(request): an echoed prompt's logprobs
        self.next_offsets: dict[int, int] = {}    # by choice: the text_offset of its next token

    def prompt_text(self, index: int) -> str:
        """The prompt an echo repeats: the client's text, or what is left of it after
        truncate_prompt_tokens, so that it matches its tokens' logprobs."""
        request = self.request_of(index)
        if isinstance(request.prompt, str) and request.params.truncate_prompt_tokens is None:
            return request.prompt
        return self.tokenizer.decode(request.seqs[0].prompt_token_ids)

    def logprobs(self, index: int, token_ids, logprobs, with_prompt: bool = False):
        """The choice's logprobs for these output tokens, which follow those of its earlier calls:
        text_offset is one running sum of the tokens' texts (as vLLM's), from after an echoed
        prompt's tokens, so it never goes back. with_prompt: the echoed prompt's tokens first."""
        if logprobs is None:
            return None
        start = self.next_offsets.get(index)
        if start is None:
            start = _end_offset(self.prompt_part(index)) if self.body.echo else 0
        out = api.completion_logprobs(self.name, token_ids, logprobs, start)
        if out["tokens"]:
            self.next_offsets[index] = _end_offset(out)
        return api.join_logprobs(self.prompt_part(index), out) if with_prompt else out

    def prompt_part(self, index: int) -> dict:
        """An echoed prompt's tokens with their logprobs (none for the first), offsets from 0;
        decoded once per request."""
        request = self.request_of(index)
        part = self.prompt_parts.get(id(request))
        if part is None:
            seq = request.seqs[0]
            prompt_logprobs = [None, *seq.prompt_logprobs]   # none for the first token
            part = self.prompt_parts[id(request)] = api.completion_logprobs(
                self.name, seq.prompt_token_ids, prompt_logprobs, 0)
        return part

    def response(self, outputs) -> dict:
        choices, echo, only = [], self.body.echo, self.body.echo_only
        prompt_logprobs = {id(r): self.prompt_logprobs(r) for r in self.requests}   # once per prompt
        for i, (out, logprobs) in enumerate(outputs):
            prefix = self.prompt_text(i) if echo else ""
            token_ids, logprobs = ([], logprobs and []) if only else (out.token_ids, logprobs)
            choices.append(
                {
                    "index": i,
                    "text": prefix + ("" if only else out.text),
                    "logprobs": self.logprobs(i, token_ids, logprobs, with_prompt=echo),
                    "finish_reason": out.finish_reason,
                    "stop_reason": out.stop_reason,
                    "prompt_logprobs": prompt_logprobs[id(self.request_of(i))],
                }
            )
        return self.envelope(self.object_name, choices=choices, usage=self.usage(outputs))

    def choice_json(self, update: Update) -> str:
        stream = self.streams[update.index]
        first = stream.sent == 0 and not stream.ids
        text = stream.delta(update)
        token_ids, logprobs = update.token_ids, update.logprobs
        if self.body.echo_only:
            text, token_ids, logprobs = "", [], logprobs and []
        if first and self.body.echo:
            text = self.prompt_text(update.index) + text
        logprobs = self.logprobs(update.index, token_ids, logprobs, first and self.body.echo)
        return (
            f'{{"index":{update.index},"text":{_encode(text)},"logprobs":{_encode(logprobs)},'
            f'"finish_reason":{_finish_json(update.output)}}}'
        )


def _end_offset(logprobs: dict) -> int:
    """The text_offset after a completion_logprobs dict's last token."""
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])


def _finish_json(out, finish_reason: str | None = None) -> str:
    """The last two fields of a streamed choice: null until its final output. finish_reason: the
    output's own unless given."""
    if out is None:
        return 'null,"stop_reason":null'
    return f'{_encode(finish_reason or out.finish_reason)},"stop_reason":{_encode(out.stop_reason)}'


class _Chat(_Reply):
    id_prefix, object_name, chunk_name = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, tokenizer, model_name: str, body, requests: list[Request], tools: ToolChoice):
        super().__init__(tokenizer, model_name, body, requests)
        self.tools = tools
        self.tool_streams = [tools.stream() for _ in self.streams]

    def response(self, outputs) -> dict:
        echo, choices = self.body.echo_text(), []
        for i, (out, logprobs) in enumerate(outputs):
            content, calls = self.tools.read(out.text)
            logprobs = None if logprobs is None else api.chat_logprobs(self.name, out.token_ids, logprobs)
            message = {"role": self.body.reply_role, "content": None if content is None else echo + content}
            if calls:
                message["tool_calls"] = calls
            choices.append({
                "index": i,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": self.tools.finish_reason(calls, out.finish_reason),
                "stop_reason": out.stop_reason,
            })
        return self.envelope(self.object_name, choices=choices, usage=self.usage(outputs),
                             prompt_logprobs=self.prompt_logprobs(self.requests[0]))

    def choice_json(self, update: Update) -> str:
        stream, tools = self.streams[update.index], self.tool_streams[update.index]
        first = not stream.ids
        delta = tools.delta(stream.delta(update), final=update.output is not None)
        if first:   # the role, and an echoed message, go with the first delta
            delta = {"role": self.body.reply_role, **delta}
            if echo := self.body.echo_text():
                delta["content"] = echo + delta.get("content", "")
        logprobs = None
        if update.logprobs is not None:
            logprobs = api.chat_logprobs(self.name, update.token_ids, update.logprobs)
        out = update.output
        if not delta and out is None and logprobs is None:   # text held back (a tool call being written)
            return ""
        reason = None if out is None else self.tools.finish_reason(tools.calls, out.finish_reason)
        return (
            f'{{"index":{update.index},"delta":{_encode(delta)},'
            f'"logprobs":{_encode(logprobs)},"finish_reason":{_finish_json(out, reason)}}}'
        )
