"""One request's way through the gateway before and after the swarm: admitted (choices, characters and the client's
concurrent streams bounded before anything is tokenized), tokenized off the event loop, checked against the context
the swarm serves, generated (api/engine.py), and answered whole or streamed (api/streaming.py)."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import math
import time
from collections import defaultdict
from typing import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from swarmlm.api import responses
from swarmlm.api.engine import Engine
from swarmlm.api.errors import ApiError, swarm_error
from swarmlm.api.schemas import new_id
from swarmlm.api.streaming import ClosingStreamingResponse, collect, first_event, sse
from swarmlm.client.decoding.sampling import Sampling

log = logging.getLogger(__name__)


class RequestHandler:
    """The gateway's requests over one swarm client: `served_id` (which model), then `admitted` (admit, tokenize,
    check, generate). `models`: served id -> its model (the base's first); `config` is the GatewayConfig."""

    def __init__(self, models: dict, tokenizer, config, engine: Engine) -> None:
        self.models, self.tokenizer, self.config, self.engine = models, tokenizer, config, engine
        self.model = models[config.model_name]  # the base: its swarm view is the gateway's
        self.aliases = dict(config.model_aliases)
        self.limits = ClientLimits(config.max_streams_per_client)
        remotes = list({id(m.remote): m.remote for m in models.values()}.values())  # (a soft prompt's: the base's)
        self.view_refresh = ViewRefresh(engine, remotes, config.view_refresh_s)
        self.scope_secret = secrets.token_bytes(32)  # users' prefix scopes derive from it (prefix_scope)

    def client_key(self, request: Request) -> str:
        """What was verified: the API key (checked by RequestGuard) when one is configured, else the peer's
        address."""
        if self.config.api_key:
            return "key"
        return f"ip:{request.client.host if request.client else '?'}"

    def prefix_scope(self, request: Request, req) -> bytes | None:
        """The requesting user's own prefix scope (server/prefix_cache.py): one per client key (the API key, or the
        peer's address when keys are off) and OpenAI `user` field, derived from this gateway's secret, so no user
        starts from (or times) another's cached prompt. None (the client's one scope) with --share-prefixes, where
        the swarm's key holders share their prefixes by choice."""
        if self.model.remote.config.prefix_share:
            return None
        return user_scope(self.scope_secret, self.client_key(request), getattr(req, "user", None))

    def served_id(self, name: str) -> str:
        """The served id a request's `model` names (an alias is answered as its id, never repeated)."""
        served = name if name in self.models else self.aliases.get(name)
        if served is None:
            raise ApiError(404, "the model does not exist on this gateway (GET /v1/models lists it)",
                           "invalid_request_error", "model_not_found", "model")
        return served

    def context_tokens(self, served: str) -> int:
        """Tokens a session of `served` may hold: the servers' limit on its route's blocks, less a soft prompt's."""
        model = self.models[served]
        limit = served_context(model.remote.view, model.remote.num_blocks)
        own = getattr(model.config, "max_position_embeddings", None)
        limits = [n for n in (limit, own) if n]
        return (min(limits) if limits else self.config.default_context_tokens) - model.virtual_tokens

    async def sampling(self, req, served: str, prompts: list[list[int]], max_tokens: int | None,
                       top_logprobs: int | None, prefix_scope: bytes | None = None) -> Sampling:
        longest = max(len(p) for p in prompts)
        if min(len(p) for p in prompts) == 0:  # nothing to prefill from (a model needs at least one token)
            raise ApiError(400, "the prompt is empty", "invalid_request_error", "invalid_request", "prompt")
        context = self.context_tokens(served)
        if longest + (max_tokens or 1) > context and await self.view_refresh():  # refused only on a fresh view
            context = self.context_tokens(served)
        room = context - longest
        if room < 1:
            raise ApiError(400, f"the prompt has {longest} tokens; the context holds {context}",
                           "invalid_request_error", "context_length_exceeded")
        if max_tokens is not None and max_tokens > room:
            raise ApiError(400, f"max_tokens {max_tokens} + the prompt's {longest} tokens exceed the context of "
                                f"{context} tokens", "invalid_request_error", "context_length_exceeded", "max_tokens")
        return Sampling.from_request(
            max_tokens or room, req.temperature, req.top_p, top_k=max(req.top_k, 0), min_p=req.min_p,
            repetition_penalty=req.penalty, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, stop=tuple(req.stop), seed=req.generator_seed,
            top_logprobs=top_logprobs, prefix_scope=prefix_scope,
        )

    def admit(self, request: Request, req, texts: list[str]) -> Callable[[], None]:
        """Bounds checked before anything is tokenized or generated; the client's slots, one per choice."""
        field = req.unsupported_field()
        if field is not None:
            raise ApiError(400, f"{field} is not supported by this gateway (text generation only)",
                           "invalid_request_error", "unsupported_parameter", field.split(" ")[0])
        choices = len(texts) * req.n
        if choices > self.config.choices_limit:
            raise ApiError(400, f"the request asks for {choices} choices (prompts x n); at most "
                                f"{self.config.choices_limit}", "invalid_request_error", "invalid_request", "n")
        chars = sum(len(t) for t in texts)
        if chars > self.config.max_prompt_chars:
            raise ApiError(400, f"the prompt has {chars} characters; at most {self.config.max_prompt_chars}",
                           "invalid_request_error", "context_length_exceeded", "prompt")
        return self.limits.acquire(self.client_key(request), choices)

    async def generate(self, request: Request, req, served: str, prompts: list[list[int]], params: Sampling,
                       render: responses.Renderer, release: Callable[[], None]):
        try:
            events = self.engine.merged(prompts, params, req.n, self.config.request_timeout_s,
                                        self.context_tokens(served), self.models[served])
            first = await first_event(events)  # before the response starts: routing errors become proper statuses
        except BaseException as exc:
            release()
            if isinstance(exc, ApiError) or not isinstance(exc, Exception):
                raise
            raise swarm_error(exc) from None
        if not req.stream:
            try:
                collected = await collect(request, events, first)
            except Exception as exc:
                raise swarm_error(exc) from None
            finally:
                release()
            if collected is None:  # the client went away: nobody reads an answer
                return Response(status_code=499)
            return JSONResponse(render.whole(collected))
        return ClosingStreamingResponse(sse(request, events, first, render, release), on_close=release,
                                        media_type="text/event-stream",
                                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def admitted(self, request: Request, req, served: str, texts: list[str],
                       encode: Callable[[], list[list[int]]], max_tokens: int | None, top_logprobs: int | None,
                       renderer: type, prefix: str):
        """Admit, tokenize off the event loop (a long prompt must not stall /health), check, generate with the
        model served as `served`."""
        release = self.admit(request, req, texts)
        try:
            prompts = await self.engine.tokenize(encode, sum(len(t) for t in texts))
            params = await self.sampling(req, served, prompts, max_tokens, top_logprobs,
                                         self.prefix_scope(request, req))
            render = renderer(new_id(prefix), served, self.tokenizer, req, prompts)
        except BaseException:
            release()
            raise
        return await self.generate(request, req, served, prompts, params, render, release)


def user_scope(secret: bytes, client_key: str, user: str | None) -> bytes:
    """A user's prefix scope token (16 bytes): HMAC-SHA256 of (client key, `user` field) under the gateway's secret."""
    return hmac.new(secret, f"{client_key}\n{user or ''}".encode(), hashlib.sha256).digest()[:16]


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
    per `min_interval_s` however many requests are refused; True when the view was read again. `remotes`: every
    view the gateway routes by (the base's, each pre-loaded adapter's)."""

    def __init__(self, engine: Engine, remotes: list, min_interval_s: float) -> None:
        self.engine, self.remotes, self.min_interval_s = engine, remotes, min_interval_s
        self.lock = asyncio.Lock()
        self.last_s = -math.inf

    async def __call__(self) -> bool:
        async with self.lock:
            if time.monotonic() - self.last_s < self.min_interval_s:
                return False
            for remote in self.remotes:
                try:
                    await self.engine.run(remote.refresh)
                except Exception as exc:  # the DHT is unreachable: decide on the view we have
                    log.warning("could not re-read the swarm: %s", exc)
            self.last_s = time.monotonic()
            return True
