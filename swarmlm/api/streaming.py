"""How an answer leaves the gateway: whole (`collect`, which notices a client that went away) or as server-sent events
in OpenAI's chunk format (`sse`), in a response that closes the choices' sessions the moment it ends."""
from __future__ import annotations

import asyncio
import contextlib
import json
from typing import AsyncIterator, Callable

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse

from swarmlm.api import responses
from swarmlm.api.errors import swarm_error
from swarmlm.api.schemas import error_body


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


async def collect(request: Request, events: AsyncIterator, first) -> list | None:
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


async def first_event(events: AsyncIterator) -> object | None:
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None


async def sse(request: Request, events: AsyncIterator, first, render: "responses.Renderer",
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
        err = swarm_error(exc)
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
