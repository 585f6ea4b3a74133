"""The OpenAI-compatible gateway: FastAPI routes around one swarm client (embeddings, head, tokenizer), serving the
base model and any tuned models on top of it (a soft prompt the gateway holds, a LoRA servers pre-load), each under
its own id: a request's `model` selects one.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both with `stream`), GET /v1/swarm,
GET / (the monitor page), GET /chat (the chat page), GET /health. A request's way (admission, the context check,
generation, streaming) is api/admission.py; errors use OpenAI's schema (api/errors.py); see docs/API.md.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Mapping

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse

from swarmlm.api import responses
from swarmlm.api.admission import RequestHandler
from swarmlm.api.engine import Engine
from swarmlm.api.errors import ApiError, add_error_handlers
from swarmlm.api.config import GatewayConfig
from swarmlm.api.guard import RequestGuard
from swarmlm.api.metrics import GatewayMetrics
from swarmlm.api.prompts import encode_chat, encode_prompt
from swarmlm.api.schemas import ChatRequest, CompletionRequest
from swarmlm.api.swarm_view import SwarmWatcher

STATIC = Path(__file__).parent / "static"
STATIC_FILES = {"monitor.js": "text/javascript", "monitor.css": "text/css", "chat.js": "text/javascript",
                "marked.umd.js": "text/javascript", "markdown.js": "text/javascript",  # marked 18.3.0 (MIT), vendored
                "chat.css": "text/css"}


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
