"""The OpenAI-compatible gateway: FastAPI routes around one swarm client (embeddings, head, tokenizer), serving the
base model and any tuned models on top of it (a soft prompt the gateway holds, a LoRA servers pre-load), each under
its own id: a request's `model` selects one.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both with `stream`), GET /v1/swarm,
GET / (the monitor page), GET /chat (the chat page), GET /health. A request's way (admission, the context check,
generation, streaming) is api/admission.py; errors use OpenAI's schema (api/errors.py); see docs/API.md.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse

from swarmlm.api import responses
from swarmlm.api.admission import RequestHandler
from swarmlm.api.engine import Engine
from swarmlm.api.errors import ApiError, add_error_handlers
from swarmlm.api.guard import LOCAL_HOSTS, RequestGuard
from swarmlm.api.metrics import GatewayMetrics
from swarmlm.api.prompts import encode_chat, encode_prompt
from swarmlm.api.schemas import ChatRequest, CompletionRequest
from swarmlm.api.swarm_view import SwarmWatcher
from swarmlm.client.decoding.decoder import parse_mode

STATIC = Path(__file__).parent / "static"
STATIC_FILES = {"monitor.js": "text/javascript", "monitor.css": "text/css", "chat.js": "text/javascript",
                "marked.umd.js": "text/javascript", "markdown.js": "text/javascript",  # marked 18.3.0 (MIT), vendored
                "chat.css": "text/css"}


@dataclass(frozen=True)
class GatewayConfig:
    model_name: str  # the base model's id: clients send it as "model", responses and pages carry it (never a path)
    adapter_names: tuple[str, ...] = ()  # the ids of the tuned models served beside it (create_app's `adapters`)
    model_aliases: tuple[tuple[str, str], ...] = ()  # (alias, id): other names accepted as "model" (--model or
    # --adapter as given), answered as the id, never shown
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
    speculative: str | int = "off"  # every choice: "off", "auto" or a fixed draft length (client/decoding/decoder.py)

    def __post_init__(self) -> None:
        ids = (self.model_name, *self.adapter_names)
        if not all(ids) or len(set(ids)) < len(ids):
            raise ValueError(f"served model ids must be distinct and not empty, got {list(ids)}")
        if any(target not in ids for _, target in self.model_aliases):
            raise ValueError(f"model_aliases {list(self.model_aliases)} must name served ids {list(ids)}")
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


def create_app(model, tokenizer, config: GatewayConfig, adapters: Mapping[str, object] | None = None) -> FastAPI:
    """`model`: the base model's client, served as config.model_name; `adapters`: id -> that model with a tuned
    model on top (model.with_adapter), one per config.adapter_names."""
    adapters = dict(adapters or {})
    if tuple(adapters) != config.adapter_names:
        raise ValueError(f"adapters {list(adapters)} are not config.adapter_names {list(config.adapter_names)}")
    metrics = GatewayMetrics()
    engine = Engine(model, tokenizer, metrics, speculative=config.speculative)
    watcher = SwarmWatcher(model.remote)
    handler = RequestHandler({config.model_name: model, **adapters}, tokenizer, config, engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.close()

    app = FastAPI(title="swarmlm", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.watcher = engine, metrics, watcher
    app.add_middleware(RequestGuard, allowed_hosts=config.allowed_hosts, api_key=config.api_key,
                       max_body_bytes=config.max_body_bytes, body_timeout_s=config.body_timeout_s)
    add_error_handlers(app)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [responses.model_card(name) for name in handler.models]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str) -> dict:
        return responses.model_card(handler.served_id(name))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        served = handler.served_id(req.model)
        return await handler.admitted(request, req, served, req.prompts,
                                      lambda: [encode_prompt(tokenizer, p) for p in req.prompts],
                                      req.max_tokens, req.logprobs, responses.CompletionRenderer, "cmpl")

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        served = handler.served_id(req.model)
        messages = [(m.role, m.text) for m in req.messages]
        top = (req.top_logprobs or 0) if req.logprobs else None
        return await handler.admitted(request, req, served, [text for _, text in messages],
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
        if name not in STATIC_FILES:
            raise ApiError(404, f"no static file {name!r}", "invalid_request_error", "not_found")
        return FileResponse(STATIC / name, media_type=STATIC_FILES[name])

    return app
