"""EngineLoop: one thread owns the engine. HTTP handlers never touch it; they send commands
(add a request, abort one) that the thread applies between steps, and receive each step's new
tokens through their asyncio queues. So there is one scheduler and one batch per step for all
clients, as in offline generate."""

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field

from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class Update:
    """What one step gave one completion of a request (delivered on the event loop)."""

    index: int  # which of the request's n completions
    token_ids: list[int]  # its new output tokens
    logprobs: list | None  # their TokenLogprobs, when the request asked
    output: object | None = None  # the final CompletionOutput once it finished


@dataclass
class Request:
    """A client's request as the engine loop sees it. The loop fills `seqs` once accepted."""

    prompt: object  # a string or token ids, as LLMEngine.add_request takes them
    params: SamplingParams
    updates: asyncio.Queue = field(default_factory=asyncio.Queue)
    choice_base: int = 0  # this request's first choice index in its HTTP response
    lora_request: object = None  # the LoRARequest of the adapter the client named as its model
    seqs: list[Sequence] = field(default_factory=list)
    # Per completion: the length of its token_ids already sent (prompt included); -1 once its final
    # output went out.
    published: list[int] = field(default_factory=list)


class EngineError(RuntimeError):
    """The engine failed while serving; the request cannot complete."""


class EngineLoop:
    """stream_interval: a completion's new tokens go out once this many have gathered (the first
    token and the last go out at once), as vLLM's --stream-interval: 1 streams every token; more
    sends fewer, larger events, for less host work per token under many streams."""

    def __init__(self, engine, loop: asyncio.AbstractEventLoop, stream_interval: int = 1):
        if not isinstance(stream_interval, int) or stream_interval < 1:
            raise ValueError(f"stream_interval must be an int >= 1, got {stream_interval!r}")
        self.engine, self.loop, self.stream_interval = engine, loop, stream_interval
        self.commands: queue.SimpleQueue = queue.SimpleQueue()  # (verb, Request | None)
        self.active: dict[int, Request] = {}  # id(request) -> request
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="nanovllm-engine-loop", daemon=True)
        self.thread.start()

    @property
    def healthy(self) -> bool:
        return self.thread.is_alive() and self.error is None

    # ---- called from the event loop -------------------------------------------------------

    async def add(self, requests: list[Request]):
        """Queue the requests of one HTTP request (one per prompt) together, so the engine's next
        step takes them all; return once the engine accepted every one, or raise the engine's
        ValueError / TypeError for the first it refused (naming its prompt), leaving none queued."""
        if not self.healthy:
            raise EngineError(f"the engine is not running: {self.error!r}")
        accepted = self.loop.create_future()
        self.commands.put(("add", (requests, accepted)))
        if not self.healthy:
            # It failed since the check above: its _fail_all may have emptied the queue before the
            # command went in, and nothing else would ever answer it.
            _settle(accepted, EngineError(f"the engine is not running: {self.error!r}"))
        await accepted

    async def call(self, fn):
        """Run fn(engine) on the engine's thread between steps and return what it returns (a whole
        offline call, as the pooling endpoints make: nanovllm/serve/pooling_routes.py); its ValueError
        or TypeError is the client's (a 400), any other failure the engine's."""
        if not self.healthy:
            raise EngineError(f"the engine is not running: {self.error!r}")
        done = self.loop.create_future()
        self.commands.put(("call", (fn, done)))
        if not self.healthy:   # as in add
            _settle(done, EngineError(f"the engine is not running: {self.error!r}"))
        return await done

    def abort(self, request: Request):
        """The client went away: stop its sequences and free their KV blocks at the next step."""
        self.commands.put(("abort", request))

    def stop(self, timeout: float = 10.0):
        self.commands.put(("stop", None))
        self.thread.join(timeout)

    # ---- the engine thread ----------------------------------------------------------------

    def _run(self):
        try:
            while self._apply_commands(block=self.engine.is_finished()):
                if not self.engine.is_finished():
                    self.engine.step()
                    self._publish()
        except BaseException as e:  # a broken engine fails every open request, never hangs one
            logger.exception("the engine loop failed")
            self.error = e
            self._fail_all(EngineError(f"the engine failed: {e!r}"))
            return
        # Stopped (the server shuts down): what was accepted is answered too, and its blocks freed.
        self.error = EngineError("the server is shutting down")
        for request in self.active.values():
            self.engine.abort(request.seqs)
        self._fail_all(self.error)

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one when the engine is idle); False on stop."""
        while True:
            try:
                verb, arg = self.commands.get(block=block, timeout=None if block else 0)
            except queue.Empty:
                return True
            block = False
            if verb == "stop":
                return False
            if verb == "add":
                self._add(*arg)
            elif verb == "call":
                self._call(*arg)
            elif verb == "abort" and id(arg) in self.active:
                self.engine.abort(arg.seqs)
                del self.active[id(arg)]

    def _add(self, requests: list[Request], accepted: asyncio.Future):
        try:
            self._add_all(requests, accepted)
        except BaseException as e:   # the engine failed, not the request: answer this add too
            self.loop.call_soon_threadsafe(_settle, accepted, EngineError(f"the engine failed: {e!r}"))
            raise   # and _run fails everything else

    def _call(self, fn, done: asyncio.Future):
        try:
            result = fn(self.engine)
        except (ValueError, TypeError) as e:   # the client's fault: a 400, the engine goes on
            self.loop.call_soon_threadsafe(_settle, done, e)
        except BaseException as e:
            self.loop.call_soon_threadsafe(_settle, done, EngineError(f"the engine failed: {e!r}"))
            raise
        else:
            self.loop.call_soon_threadsafe(_settle, done, None, result)

    def _add_all(self, requests: list[Request], accepted: asyncio.Future):
        added = []
        try:
            for i, request in enumerate(requests):
                lora = {} if request.lora_request is None else {"lora_request": request.lora_request}
                request.seqs = self.engine.add_request(request.prompt, request.params, prompt_index=i, **lora)
                added.append(request)
                self._check_room(request, i)
        except (ValueError, TypeError, ImportError) as e:  # the client's fault: a 400, the engine goes on
            for request in added:
                self.engine.abort(request.seqs)
            error = (
                ValueError(f"this server cannot serve the request: {e}") if isinstance(e, ImportError) else e
            )
            self.loop.call_soon_threadsafe(_settle, accepted, error)
            return
        for request in added:
            request.published = [seq.num_prompt_tokens for seq in request.seqs]
            self.active[id(request)] = request
        self.loop.call_soon_threadsafe(_settle, accepted, None)

    def _check_room(self, request: Request, index: int):
        """As vLLM's server (not its offline LLM, which stops at max_model_len): max_tokens must fit
        beside the prompt."""
        limit, prompt = self.engine.config.max_model_len, request.seqs[0].num_prompt_tokens
        wanted = request.params.max_tokens
        if wanted is not None and prompt + wanted > limit:
            raise ValueError(f"prompt {index}: 'max_tokens' or 'max_completion_tokens' is too large: "
                             f"{wanted}. This model's maximum context length is {limit} tokens and your "
                             f"request has {prompt} input tokens ({wanted} > {limit} - {prompt})")

    def _publish(self):
        """Send every completion's new tokens (and its final output once finished) to its request;
        one hop to the event loop per step, whatever the number of requests. This runs on the
        engine's thread between steps, for every running request: keep it lean."""
        deliveries, done = [], []
        finished, interval = SequenceStatus.FINISHED, self.stream_interval
        for key, request in self.active.items():
            published = request.published
            for i, seq in enumerate(request.seqs):
                sent = published[i]
                if sent < 0:  # its final output went out already
                    continue
                token_ids = seq.token_ids
                end = len(token_ids)
                is_finished = seq.status is finished
                if not is_finished and (
                    end == sent or (end - sent < interval and sent > seq.num_prompt_tokens)
                ):
                    continue
                logprobs = seq.logprobs
                if logprobs is not None:
                    first = sent - seq.num_prompt_tokens
                    logprobs = logprobs[first : first + end - sent]
                output = self.engine.completion_output(seq) if is_finished else None
                deliveries.append(
                    (request, Update(request.choice_base + i, token_ids[sent:end], logprobs, output))
                )
                published[i] = -1 if is_finished else end
            if max(published) < 0:
                done.append(key)
        for key in done:
            del self.active[key]
        if deliveries:
            self.loop.call_soon_threadsafe(_deliver, deliveries)

    def _fail_all(self, failure: EngineError):
        self.loop.call_soon_threadsafe(_deliver, [(r, failure) for r in self.active.values()])
        self.active.clear()
        while True:  # requests still queued: refuse them too
            try:
                verb, arg = self.commands.get_nowait()
            except queue.Empty:
                break
            if verb in ("add", "call"):
                self.loop.call_soon_threadsafe(_settle, arg[1], failure)


def _settle(future: asyncio.Future, error: BaseException | None, result=None):
    if not future.done():
        future.set_exception(error) if error is not None else future.set_result(result)


def _deliver(deliveries):
    for request, update in deliveries:
        request.updates.put_nowait(update)
