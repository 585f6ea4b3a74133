"""The gateway's outer wall: what a request must satisfy before any route reads it.

* `RequestGuard` (plain ASGI middleware, so that routes see a client's disconnect at once): the Host header is one
  of the allowed names (DNS rebinding: a web page elsewhere cannot reach a gateway on localhost through its own
  domain), /v1 routes carry the API key when one is configured, and the body is at most `max_body_bytes` and
  arrives within `body_timeout_s`.
* `header_deadline_protocol` (uvicorn's h11 protocol): a connection must send a request's headers within
  `header_timeout_s` or it is closed (slowloris: connections that trickle bytes and hold a socket for good).
  Idle kept-alive connections are closed by uvicorn's own `timeout_keep_alive`.
"""
from __future__ import annotations

import hmac
import json
import time
from typing import Iterable

import anyio
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from swarmlm.api.schemas import error_body

ANY_HOST = "*"


def host_name(header: str) -> str:
    """'example.com:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class RequestGuard:
    def __init__(self, app, allowed_hosts: Iterable[str], api_key: str | None, max_body_bytes: int,
                 body_timeout_s: float) -> None:
        self.app = app
        self.allowed = frozenset(h.lower() for h in allowed_hosts)
        self.authorization = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if ANY_HOST not in self.allowed and host_name(headers.get(b"host", b"").decode("latin-1")) not in self.allowed:
            return await _refuse(send, 400, "this gateway does not answer to that Host (see --allow-host)",
                                 "invalid_host")
        if self.authorization and scope["path"].startswith("/v1/") and not hmac.compare_digest(
                headers.get(b"authorization", b""), self.authorization):
            return await _refuse(send, 401, "missing or wrong API key (Authorization: Bearer <key>)",
                                 "invalid_api_key")
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_body_bytes:
            return await _refuse(send, 413, f"the request body exceeds {self.max_body_bytes} bytes",
                                 "request_too_large")
        return await self.app(scope, self._bounded(receive), send)

    def _bounded(self, receive):
        """`receive` that refuses a body larger than the limit (a chunked body states no length) or slower than the
        deadline, as HTTP errors (the route's body reader lets those through to the error handler)."""
        deadline = time.monotonic() + self.body_timeout_s
        seen, complete = 0, False

        async def bounded():
            nonlocal seen, complete
            if complete:  # the body is in: a later receive waits for the disconnect, as long as it takes
                return await receive()
            with anyio.move_on_after(max(deadline - time.monotonic(), 0.0)) as scope:
                message = await receive()
            if scope.cancelled_caught:
                raise HTTPException(408, f"the request body did not arrive within {self.body_timeout_s:g} s")
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise HTTPException(413, f"the request body exceeds {self.max_body_bytes} bytes")
                complete = not message.get("more_body", False)
            return message

        return bounded


async def _refuse(send, status: int, message: str, code: str) -> None:
    body = json.dumps(error_body(message, "invalid_request_error", code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class HeaderDeadlineH11(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose next request's headers take longer than
    `header_timeout_s` from their first byte (or from the connection's start). Made by header_deadline_protocol
    (GatewayConfig.header_timeout_s)."""

    header_timeout_s: float

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = None
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _too_slow(self) -> None:
        self._header_timer = None
        if self.cycle is None or self.cycle.response_complete:  # still no complete request headers
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        if self._header_timer is None and (cycle is None or cycle.response_complete):  # a next request begins
            self._arm()
        super().data_received(data)
        if self.cycle is not cycle:  # its headers are complete: the route's own limits take over
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)


def header_deadline_protocol(header_timeout_s: float) -> type[H11Protocol]:
    return type("HeaderDeadlineH11", (HeaderDeadlineH11,), {"header_timeout_s": header_timeout_s})
