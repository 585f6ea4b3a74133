"""The OpenAI-compatible gateway: FastAPI routes around one swarm client (embeddings, head, tokenizer).

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both with `stream`), GET /v1/swarm,
GET / (the monitor page), GET /chat (the chat page), GET /health. Errors use OpenAI's schema
(schemas.error_body); see docs/API.md.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from swarmlm.api import responses
from swarmlm.api.engine import Engine, RequestTimeout, SamplingParams
from swarmlm.api.guard import LOCAL_HOSTS, RequestGuard
from swarmlm.api.metrics import GatewayMetrics
from swarmlm.api.prompts import encode_chat, encode_prompt
from swarmlm.api.schemas import ChatRequest, CompletionRequest, error_body, new_id
from swarmlm.api.swarm_view import SwarmWatcher
from swarmlm.client.speculative import parse_mode
from swarmlm.errors import CapacityExceeded, InvalidRequest, MissingBlocks, ServerFailed

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"


@dataclass(frozen=True)
class GatewayConfig:
    model_name: str  # the id clients send as "model" (as the user named it)
    api_key: str | None = None  # when set, every /v1 route needs "Authorization: Bearer <key>"
    max_streams_per_client: int = 32  # concurrent choices (sessions) per API key, or per client IP without one
    max_choices_per_request: int = 16  # prompts x n of one request (each a session on every server of its route)
    max_prompt_chars: int = 262_144  # characters of a request's prompts or messages, checked before tokenizing
    max_body_bytes: int = 2 << 20  # a larger request body is refused (413) before it is read
    body_timeout_s: float = 30.0  # a body must arrive within this (408)
    request_timeout_s: float = 600.0  # a request still generating after this ends with 504 (the backstop)
    allowed_hosts: tuple[str, ...] = LOCAL_HOSTS  # Host header names answered ("*": any)
    default_context_tokens: int = 2048  # when neither the model config nor the servers state a limit
    view_refresh_s: float = 1.0  # a refused request re-reads the swarm at most this often
    speculative: str | int = "off"  # every choice: "off", "auto" or a fixed draft length (client/speculative.py)

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("model_name must not be empty")
        if self.max_streams_per_client < 1 or self.default_context_tokens < 2:
            raise ValueError(f"max_streams_per_client ({self.max_streams_per_client}) must be >= 1 and "
                             f"default_context_tokens ({self.default_context_tokens}) >= 2")
        if min(self.max_choices_per_request, self.max_prompt_chars, self.max_body_bytes) < 1:
            raise ValueError(f"max_choices_per_request ({self.max_choices_per_request}), max_prompt_chars "
                             f"({self.max_prompt_chars}) and max_body_bytes ({self.max_body_bytes}) must be >= 1")
        try:
            parse_mode(self.speculative)
        except ValueError as exc:
            raise ValueError(f"speculative: {exc}") from None
        if min(self.body_timeout_s, self.request_timeout_s) <= 0 or not self.allowed_hosts:
            raise ValueError(f"body_timeout_s ({self.body_timeout_s}) and request_timeout_s "
                             f"({self.request_timeout_s}) must be > 0 and allowed_hosts not empty")

    @property
    def choices_limit(self) -> int:
        """Choices one request may ask for: it must fit the client's own limit too."""
        return min(self.max_choices_per_request, self.max_streams_per_client)


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param


def _error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.type, exc.code, exc.param), status_code=exc.status)


def _swarm_error(exc: Exception) -> ApiError:
    """What the swarm client raised -> the HTTP error a user can act on."""
    if isinstance(exc, InvalidRequest):
        return ApiError(400, str(exc), "invalid_request_error", "invalid_request")
    if isinstance(exc, MissingBlocks):
        return ApiError(503, f"the swarm cannot serve the model: {exc}", "service_unavailable", "missing_blocks")
    if isinstance(exc, RequestTimeout):
        return ApiError(504, str(exc), "timeout", "request_timeout")
    if isinstance(exc, (ServerFailed, CapacityExceeded)):
        return ApiError(503, f"the swarm cannot serve the request now: {exc}", "service_unavailable",
                        "swarm_unavailable")
    log.exception("unexpected error while generating")
    return ApiError(500, f"internal error ({type(exc).__name__})", "server_error", "internal_error")


class ClientLimits:
    """Concurrent choices (sessions) per client key: a request holds one per choice until it ends."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active: dict[str, int] = defaultdict(int)

    def acquire(self, key: str, choices: int = 1) -> Callable[[], None]:
        if self.active[key] + choices > self.limit:
            if not self.active[key]:
                del self.active[key]
            raise ApiError(429, f"too many concurrent requests from this client (limit {self.limit} choices)",
                           "rate_limit_error", "too_many_streams")
        self.active[key] += choices
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.active[key] -= choices
                if not self.active[key]:
                    del self.active[key]

        return release


class ClosingStreamingResponse(StreamingResponse):
    """Closes the event generator as soon as the stream ends or the client goes away (not when it is collected),
    so the choices' sessions on the servers are closed at once."""

    def __init__(self, content, on_close: Callable[[], None], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()  # first and synchronous: a cancelled scope cannot skip it
            with anyio.CancelScope(shield=True):  # starlette cancels the response's scope on a disconnect
                await self.body_iterator.aclose()


def create_app(model, tokenizer, config: GatewayConfig) -> FastAPI:
    metrics = GatewayMetrics()
    engine = Engine(model, tokenizer, metrics, speculative=config.speculative)
    watcher = SwarmWatcher(model.remote)
    limits = ClientLimits(config.max_streams_per_client)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.close()

    app = FastAPI(title="swarmlm", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.watcher = engine, metrics, watcher
    app.add_middleware(RequestGuard, allowed_hosts=config.allowed_hosts, api_key=config.api_key,
                       max_body_bytes=config.max_body_bytes, body_timeout_s=config.body_timeout_s)
    view_refresh = ViewRefresh(engine, model.remote, config.view_refresh_s)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message = "the request body is not valid JSON"
        elif loc:
            message = f"{'.'.join(loc)}: {message}"
        return _error_response(ApiError(400, message, "invalid_request_error", "invalid_request",
                                        ".".join(loc) or None))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _error_response(ApiError(exc.status_code, str(exc.detail), "invalid_request_error", code))

    @app.exception_handler(Exception)
    async def _any(request: Request, exc: Exception) -> JSONResponse:
        return _error_response(_swarm_error(exc))

    def client_key(request: Request) -> str:
        """What was verified: the API key (checked by RequestGuard) when one is configured, else the peer's
        address."""
        if config.api_key:
            return "key"
        return f"ip:{request.client.host if request.client else '?'}"

    def check_model(name: str) -> None:
        if name != config.model_name:  # the served name is not repeated: it may be a local path
            raise ApiError(404, "the model does not exist on this gateway (GET /v1/models lists it)",
                           "invalid_request_error", "model_not_found", "model")

    def context_tokens() -> int:
        limit = served_context(model.remote.view, model.remote.num_blocks)
        own = getattr(model.config, "max_position_embeddings", None)
        limits_ = [n for n in (limit, own) if n]
        return min(limits_) if limits_ else config.default_context_tokens

    async def sampling(req, prompts: list[list[int]], max_tokens: int | None,
                       top_logprobs: int | None) -> SamplingParams:
        longest = max(len(p) for p in prompts)
        if min(len(p) for p in prompts) == 0:  # nothing to prefill from (a model needs at least one token)
            raise ApiError(400, "the prompt is empty", "invalid_request_error", "invalid_request", "prompt")
        context = context_tokens()
        if longest + (max_tokens or 1) > context and await view_refresh():  # refused only on a fresh view
            context = context_tokens()
        room = context - longest
        if room < 1:
            raise ApiError(400, f"the prompt has {longest} tokens; the context holds {context}",
                           "invalid_request_error", "context_length_exceeded")
        if max_tokens is not None and max_tokens > room:
            raise ApiError(400, f"max_tokens {max_tokens} + the prompt's {longest} tokens exceed the context of "
                                f"{context} tokens", "invalid_request_error", "context_length_exceeded", "max_tokens")
        return SamplingParams(
            max_tokens=max_tokens or room, temperature=req.temperature, top_p=req.top_p,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            stop=tuple(req.stop), seed=req.generator_seed, top_logprobs=top_logprobs,
        )

    def admit(request: Request, req, texts: list[str]) -> Callable[[], None]:
        """Bounds checked before anything is tokenized or generated; the client's slots, one per choice."""
        choices = len(texts) * req.n
        if choices > config.choices_limit:
            raise ApiError(400, f"the request asks for {choices} choices (prompts x n); at most "
                                f"{config.choices_limit}", "invalid_request_error", "invalid_request", "n")
        chars = sum(len(t) for t in texts)
        if chars > config.max_prompt_chars:
            raise ApiError(400, f"the prompt has {chars} characters; at most {config.max_prompt_chars}",
                           "invalid_request_error", "context_length_exceeded", "prompt")
        return limits.acquire(client_key(request), choices)

    async def generate(request: Request, req, prompts: list[list[int]], params: SamplingParams,
                       render: responses.Renderer, release: Callable[[], None]):
        try:
            events = engine.merged(prompts, params, req.n, config.request_timeout_s)
            first = await _first(events)  # before the response starts: routing errors become proper statuses
        except BaseException as exc:
            release()
            if isinstance(exc, ApiError) or not isinstance(exc, Exception):
                raise
            raise _swarm_error(exc) from None
        if not req.stream:
            try:
                collected = await _collect(request, events, first)
            except Exception as exc:
                raise _swarm_error(exc) from None
            finally:
                release()
            if collected is None:  # the client went away: nobody reads an answer
                return Response(status_code=499)
            return JSONResponse(render.whole(collected))
        return ClosingStreamingResponse(_sse(request, events, first, render, release), on_close=release,
                                        media_type="text/event-stream",
                                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def admitted(request: Request, req, texts: list[str], encode: Callable[[], list[list[int]]],
                       max_tokens: int | None, top_logprobs: int | None, renderer: type, prefix: str):
        """Admit, tokenize off the event loop (a long prompt must not stall /health), check, generate."""
        release = admit(request, req, texts)
        try:
            prompts = await engine.tokenize(encode, sum(len(t) for t in texts))
            params = await sampling(req, prompts, max_tokens, top_logprobs)
            render = renderer(new_id(prefix), config.model_name, tokenizer, req, prompts)
        except BaseException:
            release()
            raise
        return await generate(request, req, prompts, params, render, release)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [responses.model_card(config.model_name)]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str) -> dict:
        check_model(name)
        return responses.model_card(config.model_name)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
        return await admitted(request, req, req.prompts, lambda: [encode_prompt(tokenizer, p) for p in req.prompts],
                              req.max_tokens, req.logprobs, responses.CompletionRenderer, "cmpl")

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        check_model(req.model)
        messages = [(m.role, m.text) for m in req.messages]
        top = (req.top_logprobs or 0) if req.logprobs else None
        return await admitted(request, req, [text for _, text in messages],
                              lambda: [encode_chat(tokenizer, messages)], req.token_limit, top,
                              responses.ChatRenderer, "chatcmpl")

    @app.get("/v1/swarm")
    async def swarm() -> dict:
        view = await engine.run(watcher.read)
        return {"model": config.model_name, **view, "gateway": metrics.snapshot()}

    @app.get("/")
    async def monitor() -> FileResponse:
        return FileResponse(STATIC / "monitor.html", media_type="text/html")

    @app.get("/chat")
    async def chat_page() -> FileResponse:
        return FileResponse(STATIC / "chat.html", media_type="text/html")

    @app.get("/static/{name}")
    async def static(name: str) -> FileResponse:
        files = {"monitor.js": "text/javascript", "monitor.css": "text/css", "chat.js": "text/javascript",
                 "chat.css": "text/css"}
        if name not in files:
            raise ApiError(404, f"no static file {name!r}", "invalid_request_error", "not_found")
        return FileResponse(STATIC / name, media_type=files[name])

    return app


def served_context(view, num_blocks: int) -> int | None:
    """The longest context some route offers: per block the largest `max_length` among the servers that passed the
    connect check (measured: a forged record for an address that never answered counts for nothing), then the
    smallest over the blocks. None when no verified server states a limit."""
    verified = [r for sid, r in view.records.items() if sid in view.rtt_s]
    per_block = [max((r.max_length if r.max_length > 0 else math.inf for r in verified if r.start <= b < r.end),
                     default=math.inf) for b in range(num_blocks)]
    limit = min(per_block, default=math.inf)
    return None if limit == math.inf else int(limit)


class ViewRefresh:
    """Re-reads the swarm (DHT records + connect checks) before a request is refused for its context, at most once
    per `min_interval_s` however many requests are refused; True when the view was read again."""

    def __init__(self, engine: Engine, remote, min_interval_s: float) -> None:
        self.engine, self.remote, self.min_interval_s = engine, remote, min_interval_s
        self.lock = asyncio.Lock()
        self.last_s = -math.inf

    async def __call__(self) -> bool:
        async with self.lock:
            if time.monotonic() - self.last_s < self.min_interval_s:
                return False
            try:
                await self.engine.run(self.remote.refresh)
            except Exception as exc:  # the DHT is unreachable: decide on the view we have
                log.warning("could not re-read the swarm: %s", exc)
            self.last_s = time.monotonic()
            return True


async def _collect(request: Request, events: AsyncIterator, first) -> list | None:
    """A non-streaming request's events; None (every choice stopped, its sessions closed) if the client went
    away meanwhile. The disconnect is awaited, as starlette's streaming responses await it, not polled: a poll
    (`is_disconnected()`, a receive cancelled before it starts) can take a stale wake-up for a message."""
    async def read() -> list:
        return [first] + [e async for e in events] if first is not None else []

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(read()), asyncio.ensure_future(gone())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task in done else None
    finally:
        for pending in (task, watch):
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending
        with anyio.CancelScope(shield=True):
            await events.aclose()


async def _first(events: AsyncIterator) -> object | None:
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None


async def _sse(request: Request, events: AsyncIterator, first, render: "responses.Renderer",
               release: Callable[[], None]) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`."""
    try:
        for chunk in render.start():
            yield _data(chunk)
        pending = [first] if first is not None else []
        async for event in _chain(pending, events):
            for chunk in render.chunk(event):
                yield _data(chunk)
            if await request.is_disconnected():  # between tokens: stop the choices, close their sessions
                return
        for chunk in render.end():
            yield _data(chunk)
        yield "data: [DONE]\n\n"
    except Exception as exc:  # after the response started: an error event, then the end of the stream
        err = _swarm_error(exc)
        yield _data(error_body(err.message, err.type, err.code))
        yield "data: [DONE]\n\n"
    finally:
        release()
        with anyio.CancelScope(shield=True):
            await events.aclose()


async def _chain(first: list, rest: AsyncIterator) -> AsyncIterator:
    for e in first:
        yield e
    async for e in rest:
        yield e


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

