"""The HTTP side: `create_app(engine, tokenizer, model_name, generation_defaults)` -> a FastAPI app speaking
OpenAI's API over a running `g4ops.engine.batch.BatchEngine`.

Threads: the engine's own thread owns the model and the device; everything here runs on the asyncio loop (plus
worker threads for tokenization) and touches only token ids and text. The engine's per-token callback only
timestamps the event and appends it to `_Bridge`, which wakes the loop once for everything that arrived meanwhile
(one decode step's tokens for every request: one wake-up, not one per request); each request reads its events from
an asyncio queue, taking every event already there at once, so a slow client or a busy loop gets fewer, larger
chunks instead of falling behind.

A request leaves the engine when it ends, when a stop string matches, when its client disconnects (streaming or
not) and at shutdown (the lifespan's exit calls `engine.shutdown()`, which ends what is in flight)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from ..engine.batch import QueueFull, TokenEvent
from . import protocol as p
from .metrics import ServerMetrics
from .params import GenerationDefaults, PromptTooLong, sampling_params
from .text import Detokenizer, StopMatcher


class APIError(Exception):
    """An OpenAI-style error answer."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 body: p.ErrorResponse | None = None):  # fmt: skip
        self.body = body or p.ErrorResponse(error=p.ErrorInfo(message=message, type=type_, param=param))
        super().__init__(self.body.error.message)
        self.status = status


class _Ended(Exception):
    """The engine ended a request that was still running: shutdown ("cancelled") or a failure ("error")."""

    def __init__(self, event: TokenEvent):
        reason = "the server is shutting down" if event.finish_reason == "cancelled" else f"engine error: {event.error}"
        super().__init__(reason)
        self.body = p.ErrorResponse(error=p.ErrorInfo(message=reason, type="server_error"))


class _Bridge:
    """Engine thread -> asyncio loop: items posted while a hand-over is pending ride along with it."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._items: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, queue: asyncio.Queue, item) -> None:  # any thread
        self._items.append((queue, item))
        with self._lock:
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _deliver(self) -> None:  # the loop
        with self._lock:
            self._scheduled = False  # before draining: an item posted from now on schedules another delivery
        while self._items:
            queue, item = self._items.popleft()
            queue.put_nowait(item)


class _Generation:
    """One request in the engine: its events, bridged to the loop, become text deltas (`deltas()`)."""

    def __init__(self, server: _Server, prompt_ids: list[int], params, stops: tuple[str, ...], arrival: float):
        self.server, self.arrival = server, arrival
        self._bridge = server.bridge()
        self.queue: asyncio.Queue[tuple[TokenEvent, float]] = asyncio.Queue()
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self._stop_ids = frozenset(params.stop_token_ids)
        self._detok = Detokenizer(server.tokenizer)
        self._stops = StopMatcher(stops)
        self._last: float | None = None
        self._closed = False
        self.id = server.engine.submit(prompt_ids, params, self._on_event)  # ValueError, QueueFull
        server.metrics.prompt_tokens.inc(len(prompt_ids))

    def _on_event(self, event: TokenEvent) -> None:  # the engine thread: must be cheap and must not raise
        self._bridge.post(self.queue, (event, time.perf_counter()))

    def usage(self) -> p.Usage:
        return p.Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                       total_tokens=self.prompt_tokens + self.completion_tokens)

    def _consume(self, event: TokenEvent, at: float) -> str:
        if self.finish_reason is not None:  # a stop string already ended it; the engine's tail is moot
            return ""
        metrics, text = self.server.metrics, ""
        if event.token_id is not None:
            self.completion_tokens += 1
            metrics.generation_tokens.inc()
            if self._last is None:
                metrics.ttft.observe(at - self.arrival)
            else:
                metrics.itl.observe(at - self._last)
            self._last = at
            if not (event.finish_reason == "stop" and event.token_id in self._stop_ids):
                text = self._stops.feed(self._detok.add(event.token_id))
                if self._stops.stopped:
                    self.finish_reason = "stop"
                    self.server.engine.cancel(self.id)
                    return text
        if event.finish_reason in ("stop", "length"):
            self.finish_reason = event.finish_reason
            return text + self._stops.feed(self._detok.flush()) + self._stops.finish()
        if event.finish_reason is not None:
            raise _Ended(event)
        return text

    async def deltas(self) -> AsyncIterator[str]:
        """Text pieces until the end; then `finish_reason` is "stop" or "length". Raises _Ended if the engine ended
        the request. Closing the iterator early (disconnect, cancellation) takes the request out of the engine."""
        outcome = "abort"
        try:
            while self.finish_reason is None:
                batch = [await self.queue.get()]
                while not self.queue.empty():
                    batch.append(self.queue.get_nowait())
                text = "".join(self._consume(event, at) for event, at in batch)
                if text:
                    yield text
            outcome = self.finish_reason
        except _Ended:
            outcome = "error"
            raise
        finally:
            self.close(outcome)

    def close(self, outcome: str = "abort") -> None:
        """Record how the request ended, taking it out of the engine unless it finished there (idempotent). Also
        called when a response ends without ever iterating `deltas()` (a client gone before the first chunk)."""
        if self._closed:
            return
        self._closed = True
        if outcome == "abort":
            self.server.engine.cancel(self.id)
        self.server.metrics.finished[outcome].inc()
        self.server.metrics.e2e.observe(time.perf_counter() - self.arrival)

    async def text(self) -> str:
        return "".join([piece async for piece in self.deltas()])


async def _until_disconnect(request: Request) -> None:
    """Returns when the client has gone (the body is already read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _EngineStream(StreamingResponse):
    """A streaming response that closes its generation however the response ends, even before the body started
    (a generator that never ran has no `finally` to run)."""

    def __init__(self, body: AsyncIterator[str], generation: _Generation):
        super().__init__(body, media_type="text/event-stream")
        self.generation = generation

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()


def _sse(obj: BaseModel) -> str:
    return f"data: {obj.model_dump_json(exclude_none=True)}\n\n"


_DONE = "data: [DONE]\n\n"
_CLIENT_GONE = 499  # nginx's "client closed request"; nobody reads it


class _Server:
    def __init__(self, engine, tokenizer, model_name: str, defaults: GenerationDefaults):
        self.engine, self.tokenizer, self.model_name, self.defaults = engine, tokenizer, model_name, defaults
        self.vocab = len(tokenizer)
        self.metrics = ServerMetrics(engine, model_name)
        self.stopping = False  # the lifespan is ending, or the engine refused a request as shut down
        self._bridge: _Bridge | None = None

    def bridge(self) -> _Bridge:
        """The bridge into the running loop (made on first use: the app is built before uvicorn starts a loop)."""
        loop = asyncio.get_running_loop()
        if self._bridge is None or self._bridge._loop is not loop:
            self._bridge = _Bridge(loop)
        return self._bridge

    # -- requests to token ids (worker threads) --
    def chat_ids(self, req: p.ChatCompletionRequest) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(req.chat(), add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - the template's own checks (jinja raise_exception) are input errors
            raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from exc
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]  # the template wrote bos itself

    def completion_ids(self, req: p.CompletionRequest) -> list[int]:
        if isinstance(req.prompt, str):
            return self.tokenizer(req.prompt)["input_ids"]
        bad = next((t for t in req.prompt if t >= self.vocab), None)
        if bad is not None:
            raise APIError(400, f"prompt: token id {bad} is outside the vocabulary [0, {self.vocab})", param="prompt")
        return list(req.prompt)

    # -- the engine --
    def start(self, req, prompt_ids: list[int], arrival: float) -> _Generation:
        if req.model != self.model_name:
            raise APIError(404, f"the model `{req.model}` does not exist; this server serves `{self.model_name}`",
                           type_="not_found_error", param="model")
        try:
            params = sampling_params(req, self.defaults, len(prompt_ids), self.engine.max_context)
        except PromptTooLong as exc:
            raise APIError(400, str(exc), param=exc.param) from exc
        try:
            return _Generation(self, prompt_ids, params, req.stop_strings(), arrival)
        except QueueFull as exc:
            raise APIError(429, f"the server is overloaded, retry later ({exc})", type_="rate_limit_error") from exc
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        except RuntimeError as exc:  # submit after shutdown
            self.stopping = True
            raise APIError(503, f"the server is shutting down ({exc})", type_="server_error") from exc

    async def answer(self, request: Request, generation: _Generation) -> str | None:
        """The whole text of a non-streaming request; None (and the request leaves the engine) if its client
        disconnects first."""
        collect = asyncio.ensure_future(generation.text())
        gone = asyncio.ensure_future(_until_disconnect(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():
                collect.cancel()
                generation.close()  # now, not when the cancelled task next runs
        if collect.cancelled():
            return None
        try:
            return collect.result()
        except _Ended as exc:
            raise APIError(503, str(exc), type_="server_error") from exc

    # -- streams --
    async def chat_stream(self, req: p.ChatCompletionRequest, gen: _Generation) -> AsyncIterator[str]:
        head = dict(id=p.new_id("chat"), created=int(time.time()), model=self.model_name)
        opening = p.ChatChunkChoice(delta=p.Delta(role="assistant", content=""))
        yield _sse(p.ChatCompletionChunk(**head, choices=[opening]))
        try:
            async for piece in gen.deltas():
                yield _sse(p.ChatCompletionChunk(**head, choices=[p.ChatChunkChoice(delta=p.Delta(content=piece))]))
            yield _sse(p.ChatCompletionChunk(**head, choices=[p.ChatChunkChoice(delta=p.Delta(),
                                                                                finish_reason=gen.finish_reason)]))
            if req.stream_options is not None and req.stream_options.include_usage:
                yield _sse(p.ChatCompletionChunk(**head, choices=[], usage=gen.usage()))
        except _Ended as exc:
            yield _sse(exc.body)
        yield _DONE

    async def completion_stream(self, req: p.CompletionRequest, gen: _Generation) -> AsyncIterator[str]:
        head = dict(id=p.new_id("completion"), created=int(time.time()), model=self.model_name)
        try:
            async for piece in gen.deltas():
                yield _sse(p.Completion(**head, choices=[p.CompletionChoice(text=piece)]))
            yield _sse(p.Completion(**head, choices=[p.CompletionChoice(text="", finish_reason=gen.finish_reason)]))
            if req.stream_options is not None and req.stream_options.include_usage:
                yield _sse(p.Completion(**head, choices=[], usage=gen.usage()))
        except _Ended as exc:
            yield _sse(exc.body)
        yield _DONE


async def _parse(request: Request, model: type[BaseModel]):
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise APIError(400, "", body=p.validation_error(exc)) from exc


def create_app(engine, tokenizer, model_name: str, generation_defaults: GenerationDefaults | None = None,
               shutdown_timeout: float | None = 30.0) -> FastAPI:  # fmt: skip
    """The server over a started `engine`. `tokenizer`: a transformers tokenizer with a chat template.
    `generation_defaults`: sampling for unset request fields (default: transformers' defaults, no stop tokens).
    Leaving the app's lifespan shuts the engine down (waiting up to `shutdown_timeout` s for its thread)."""
    defaults = generation_defaults or GenerationDefaults.from_generation_config(None)
    server = _Server(engine, tokenizer, model_name, defaults)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        server.stopping = True
        await asyncio.to_thread(engine.shutdown, shutdown_timeout)

    app = FastAPI(title="g4ops", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body.model_dump(), status_code=exc.status)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.perf_counter()
        req = await _parse(request, p.ChatCompletionRequest)
        prompt_ids = await asyncio.to_thread(server.chat_ids, req)
        gen = server.start(req, prompt_ids, arrival)
        if req.stream:
            return _EngineStream(server.chat_stream(req, gen), gen)
        text = await server.answer(request, gen)
        if text is None:
            return Response(status_code=_CLIENT_GONE)
        choice = p.ChatChoice(message=p.AssistantMessage(content=text), finish_reason=gen.finish_reason)
        return JSONResponse(p.ChatCompletion(id=p.new_id("chat"), model=server.model_name, choices=[choice],
                                             usage=gen.usage()).model_dump())

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.perf_counter()
        req = await _parse(request, p.CompletionRequest)
        prompt_ids = await asyncio.to_thread(server.completion_ids, req)
        gen = server.start(req, prompt_ids, arrival)
        if req.stream:
            return _EngineStream(server.completion_stream(req, gen), gen)
        text = await server.answer(request, gen)
        if text is None:
            return Response(status_code=_CLIENT_GONE)
        choice = p.CompletionChoice(text=text, finish_reason=gen.finish_reason)
        return JSONResponse(p.Completion(id=p.new_id("completion"), model=server.model_name, choices=[choice],
                                         usage=gen.usage()).model_dump())

    @app.get("/v1/models")
    async def models():
        return JSONResponse(p.ModelList(data=[p.ModelCard(id=server.model_name, max_model_len=engine.max_context)])
                            .model_dump())

    @app.get("/health")
    async def health():
        if server.stopping:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        engine.stats()  # raises if the engine is broken
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics():
        body, content_type = server.metrics.render()
        return Response(body, media_type=content_type)

    return app
