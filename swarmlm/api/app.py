"""The OpenAI-compatible gateway: FastAPI routes around one swarm client (embeddings, head, tokenizer).

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both with `stream`), GET /v1/swarm,
GET / (the monitor page), GET /chat (the chat page), GET /health. Errors use OpenAI's schema
(schemas.error_body); see docs/API.md.
"""
from __future__ import annotations

import contextlib
import json
import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from swarmlm.api import responses
from swarmlm.api.engine import Engine, SamplingParams
from swarmlm.api.metrics import GatewayMetrics
from swarmlm.api.prompts import encode_chat, encode_prompt
from swarmlm.api.schemas import ChatRequest, CompletionRequest, error_body, new_id
from swarmlm.api.swarm_view import SwarmWatcher
from swarmlm.errors import CapacityExceeded, InvalidRequest, MissingBlocks, ServerFailed

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"


@dataclass(frozen=True)
class GatewayConfig:
    model_name: str  # the id clients send as "model" (as the user named it)
    api_key: str | None = None  # when set, every /v1 route needs "Authorization: Bearer <key>"
    max_streams_per_client: int = 32  # concurrent generation requests per API key (or client IP without one)
    default_context_tokens: int = 2048  # when neither the model config nor the servers state a limit

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("model_name must not be empty")
        if self.max_streams_per_client < 1 or self.default_context_tokens < 2:
            raise ValueError(f"max_streams_per_client ({self.max_streams_per_client}) must be >= 1 and "
                             f"default_context_tokens ({self.default_context_tokens}) >= 2")


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
    if isinstance(exc, (ServerFailed, CapacityExceeded)):
        return ApiError(503, f"the swarm cannot serve the request now: {exc}", "service_unavailable",
                        "swarm_unavailable")
    log.exception("unexpected error while generating")
    return ApiError(500, f"internal error ({type(exc).__name__})", "server_error", "internal_error")


class ClientLimits:
    """Concurrent generation requests per client key."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active: dict[str, int] = defaultdict(int)

    def acquire(self, key: str) -> Callable[[], None]:
        if self.active[key] >= self.limit:
            raise ApiError(429, f"too many concurrent requests from this client (limit {self.limit})",
                           "rate_limit_error", "too_many_streams")
        self.active[key] += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.active[key] -= 1
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
    engine = Engine(model, tokenizer, metrics)
    watcher = SwarmWatcher(model.remote)
    limits = ClientLimits(config.max_streams_per_client)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.close()

    app = FastAPI(title="swarmlm", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.watcher = engine, metrics, watcher

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

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if config.api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {config.api_key}":
                return _error_response(ApiError(401, "missing or wrong API key (Authorization: Bearer <key>)",
                                                "invalid_request_error", "invalid_api_key"))
        return await call_next(request)

    def client_key(request: Request) -> str:
        auth = request.headers.get("authorization", "")
        return auth if auth else f"ip:{request.client.host if request.client else '?'}"

    def check_model(name: str) -> None:
        if name != config.model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this gateway serves {config.model_name!r}",
                           "invalid_request_error", "model_not_found", "model")

    def context_tokens() -> int:
        limits_ = [int(r.max_length) for r in model.remote.view.records.values() if r.max_length > 0]
        limit = getattr(model.config, "max_position_embeddings", None)
        if limit:
            limits_.append(int(limit))
        return min(limits_) if limits_ else config.default_context_tokens

    def sampling(req, prompts: list[list[int]], max_tokens: int | None, top_logprobs: int | None) -> SamplingParams:
        context = context_tokens()
        longest = max(len(p) for p in prompts)
        if min(len(p) for p in prompts) == 0:  # nothing to prefill from (a model needs at least one token)
            raise ApiError(400, "the prompt is empty", "invalid_request_error", "invalid_request", "prompt")
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
            stop=tuple(req.stop), seed=req.seed, top_logprobs=top_logprobs,
        )

    async def generate(request: Request, req, prompts: list[list[int]], params: SamplingParams,
                       render: responses.Renderer):
        release = limits.acquire(client_key(request))
        try:
            events = engine.merged(prompts, params, req.n)
            first = await _first(events)  # before the response starts: routing errors become proper statuses
        except BaseException as exc:
            release()
            if isinstance(exc, ApiError) or not isinstance(exc, Exception):
                raise
            raise _swarm_error(exc) from None
        if not req.stream:
            try:
                collected = [first] + [e async for e in events] if first is not None else []
            except Exception as exc:
                raise _swarm_error(exc) from None
            finally:
                await events.aclose()
                release()
            return JSONResponse(render.whole(collected))
        return ClosingStreamingResponse(_sse(request, events, first, render, release), on_close=release,
                                        media_type="text/event-stream",
                                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": config.model_name}

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
        prompts = [encode_prompt(tokenizer, p) for p in req.prompts]
        params = sampling(req, prompts, req.max_tokens, req.logprobs)
        render = responses.CompletionRenderer(new_id("cmpl"), config.model_name, tokenizer, req, prompts)
        return await generate(request, req, prompts, params, render)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        check_model(req.model)
        prompt = encode_chat(tokenizer, [(m.role, m.text) for m in req.messages])
        top = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling(req, [prompt], req.token_limit, top)
        render = responses.ChatRenderer(new_id("chatcmpl"), config.model_name, tokenizer, req, [prompt])
        return await generate(request, req, [prompt], params, render)

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

