"""The framed step port (wire/frames.py): Inference streams and pushes on plain TCP, beside gRPC, served by the same
SwarmService handlers on the same event loop (a lone decode step computes inline there: the thread that computes
is the one that waits on the socket, docs/ARCHITECTURE.md).

Frames are cut from the bytes as they arrive (`FrameConnection.data_received`, on the loop). A stream's requests go
from there straight into its session's inbox (`FramedRequests.feed`): no reader task between the socket and the
step, so a decode step costs the loop one wake-up, not two. When the inbox or the peer's bytes in flight are full,
reading pauses until there is room (as HTTP/2 flow control holds a gRPC client back).

Same trust as gRPC: a private swarm's token in the HELLO (the same check, method names and replay memory as the
gRPC interceptor's), session secrets checked by the handlers themselves. A connection that breaks the framing gets
a STATUS saying why and is closed; other connections are not affected.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Awaitable, Callable

import grpc

from swarmlm.config import ServerConfig
from swarmlm.server.inbound import request_of
from swarmlm.swarm.private import HINT, TokenChecker
from swarmlm.wire import frames
from swarmlm.wire.frames import INFERENCE_METHOD, PUSH_METHOD, FrameError, Kind, Purpose

log = logging.getLogger(__name__)


class Aborted(Exception):
    """`context.abort` of a handler: the stream ends with this status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class FrameContext:
    """What the service's handlers use of a gRPC context: the peer, abort, and a unary call's status."""

    def __init__(self, peer: str) -> None:
        self._peer = peer
        self.code, self.details = grpc.StatusCode.OK, ""

    def peer(self) -> str:
        return self._peer

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise Aborted(code, details)

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


def _peer_of(transport: asyncio.BaseTransport) -> str:
    """As gRPC names a peer ("ipv4:1.2.3.4:5678"): quotas count per host either way (server/checks.peer_host)."""
    name = transport.get_extra_info("peername")
    if not name:
        return "unknown"
    host, port = name[0], name[1]
    return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


Frame = tuple[Kind, bytes]
Item = Frame | FrameError | None  # what a connection yields: a frame, why it broke, or None (a clean end)


class FrameConnection(asyncio.Protocol):
    """One framed connection: its bytes cut into frames as they arrive. Frames wait in `queued` for `next_frame`
    (the HELLO, a stream's first request, pushes) until a `sink` takes each one as it is cut (a stream's requests).
    After a broken frame or the end, nothing more is read."""

    def __init__(self, server: "FrameServer") -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()  # bytes read, not yet cut into frames
        self.limit = frames.MAX_HELLO_BYTES  # the next frame's size limit (the HELLO's, then max_message_bytes)
        self.queued: deque[Item] = deque()
        self.sink: Callable[[Item], None] | None = None
        self.done = False  # a broken frame or the end was seen: no more frames
        self._waiter: asyncio.Future | None = None  # next_frame's
        self._can_write: asyncio.Future | None = None  # set while the transport's write buffer is full
        self._stall: asyncio.TimerHandle | None = None  # a begun frame's deadline

    # ---- bytes in -------------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.server.open(self)

    def data_received(self, data: bytes) -> None:
        if self.done:
            return
        self.buf += data
        try:
            while not self.done and (got := frames.parse_frame(self.buf, self.limit)) is not None:
                self.limit = self.server.max_body_bytes
                self._put(got)
        except FrameError as exc:
            self._put(exc)
        if self.buf and not self.done and self._stall is None:
            timeout_s = self.server.body_timeout_s if self.limit != frames.MAX_HELLO_BYTES else frames.HELLO_TIMEOUT_S
            self._stall = asyncio.get_running_loop().call_later(timeout_s, self._stalled, timeout_s)
        elif not self.buf and self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def eof_received(self) -> bool:
        if not self.done:
            self._put(self._truncated() if self.buf else None)
        return True  # keep the transport open to write the STATUS

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done:
            self._put(self._truncated() if self.buf else None)
        if self._can_write is not None and not self._can_write.done():
            self._can_write.set_exception(ConnectionResetError("the connection was lost"))

    def _truncated(self) -> FrameError:
        if len(self.buf) < frames.HEADER.size:
            return FrameError(f"truncated frame: the connection ended after {len(self.buf)} of {frames.HEADER.size} "
                              f"header bytes")
        size = frames.HEADER.unpack_from(self.buf)[0]
        return FrameError(f"truncated frame: the connection ended after {len(self.buf) - frames.HEADER.size} of "
                          f"{size} body bytes")

    def _stalled(self, timeout_s: float) -> None:
        self._stall = None
        if not self.done and self.buf:
            size = frames.HEADER.unpack_from(self.buf)[0] if len(self.buf) >= frames.HEADER.size else 0
            self._put(FrameError(f"a frame of {size} bytes did not arrive within {timeout_s} s"))

    def _put(self, item: Item) -> None:
        if not isinstance(item, tuple):  # broken or ended: nothing more is read
            self.done = True
            self.buf.clear()
            if self._stall is not None:
                self._stall.cancel()
                self._stall = None
        if self.sink is not None:
            self.sink(item)
            return
        self.queued.append(item)
        if len(self.queued) > 1 and not self.done:
            self.pause()  # (frames nobody asked for yet: at most one read's worth)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait_frame(self) -> None:
        """Until a frame (or the end) is queued."""
        while not self.queued:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def next_frame(self) -> Item:
        await self.wait_frame()
        item = self.queued.popleft()
        if not self.queued:
            self.resume()
        return item

    def pause(self) -> None:
        if self.transport is not None and self.transport.is_reading():
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.done and not self.transport.is_closing():
            self.transport.resume_reading()

    # ---- bytes out ------------------------------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        if self.transport.is_closing():
            raise ConnectionResetError("the connection is closed")
        self.transport.write(data)

    async def drain(self) -> None:
        if self._can_write is not None:
            await self._can_write

    def pause_writing(self) -> None:
        self._can_write = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._can_write is not None and not self._can_write.done():
            self._can_write.set_result(None)
        self._can_write = None


class FramedRequests:
    """A stream's REQUEST frames as the service's request iterator: parsed InferenceRequests (UNPARSABLE when they
    do not parse, as on gRPC), until END. A broken frame ends it with the FrameError (kept in `broken` for the
    STATUS); a connection that ends without END, with ConnectionResetError. The service reads the first request
    with `__anext__`, then lets `feed` put the rest into the session's inbox as they arrive."""

    def __init__(self, conn: FrameConnection, broken: list[FrameError]) -> None:
        self.conn = conn
        self.broken = broken
        self._pending: deque[Item] = deque()  # frames cut while the inbox had no room: taken in order by `feed`
        self._slow = False  # `feed` is taking pending frames: later ones wait behind them (reading paused)
        self._wake: asyncio.Future | None = None
        self._feeding: asyncio.Task | None = None  # the task in `feed` (its cancellation ends the stream's intake)
        self.ended = False  # END was read: the client ended this stream cleanly (its connection may carry another)

    def __aiter__(self) -> "FramedRequests":
        return self

    async def __anext__(self):
        return self._request(await self.conn.next_frame())

    def _request(self, item: Item):
        """A frame as a request; StopAsyncIteration at END; the stream's end as an exception otherwise."""

        if item is None:
            raise ConnectionResetError("the connection ended without END")
        if isinstance(item, FrameError):
            self.broken.append(item)
            raise item
        kind, body = item
        if kind == Kind.END:
            self.ended = True
            raise StopAsyncIteration
        if kind != Kind.REQUEST:
            self.broken.append(FrameError(f"a {kind.name} frame inside a stream (expected REQUEST or END)"))
            raise self.broken[-1]
        return request_of("Inference", body)

    async def feed(self, take_now: Callable[[object], bool], take: Callable[[object], Awaitable[None]]) -> None:
        """Every later request into the session's inbox: `take_now` (in data_received: the inbox and the peer's
        bytes have room now, else nothing is done) as each frame is cut; while that fails, reading pauses and this
        task `take`s the waiting frames in order (which waits for room). Returns at END; raises as __anext__."""
        conn = self.conn
        self._feeding = asyncio.current_task()
        self._pending.extend(conn.queued)
        conn.queued.clear()
        conn.sink = lambda item: self._arrived(item, take_now)
        try:
            while True:
                self._slow = bool(self._pending)
                while self._pending:
                    try:
                        request = self._request(self._pending.popleft())
                    except StopAsyncIteration:  # frames after END are the connection's: its next HELLO...
                        conn.queued.extendleft(reversed(self._pending))
                        self._pending.clear()
                        return
                    await take(request)
                self._slow = False
                conn.resume()
                self._wake = asyncio.get_running_loop().create_future()
                await self._wake
        finally:
            conn.sink = None

    def _arrived(self, item: Item, take_now: Callable[[object], bool]) -> None:
        if self._feeding.cancelling():  # the stream ended (its bytes in flight released): nothing more goes in
            return
        if not self._slow and isinstance(item, tuple) and item[0] == Kind.REQUEST:
            try:
                if take_now(self._request(item)):
                    return
            except Exception:  # (a bug: the stream ends, as a broken reader's would)
                log.exception("a framed request could not be queued")
                item = FrameError("the server could not queue the request")
        self._pending.append(item)
        self._slow = True
        self.conn.pause()
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)


class FrameServer:
    def __init__(self, service, config: ServerConfig, checker: TokenChecker | None) -> None:
        self.service = service  # server/service.SwarmService
        self.max_body_bytes = config.max_message_bytes
        self.body_timeout_s = config.session_idle_timeout_s  # a begun frame that stalls this long ends its stream
        self.max_connections = config.max_concurrent_rpcs  # as gRPC's limit on concurrent calls
        self.idle_timeout_s = config.frame_idle_timeout_s  # a connection between streams waits this long for a HELLO
        self.checker = checker  # the gRPC interceptor's: one replay memory for both transports
        self.connections: set[asyncio.Task] = set()
        self.refused = 0  # connections refused: framing, swarm key or too many
        self._server: asyncio.Server | None = None

    async def start(self, host: str) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: FrameConnection(self), host, 0, reuse_port=False)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self.connections):
            task.cancel()
        await asyncio.gather(*self.connections, return_exceptions=True)

    def open(self, conn: FrameConnection) -> None:
        task = asyncio.ensure_future(self._connection(conn))
        self.connections.add(task)
        task.add_done_callback(self.connections.discard)

    async def _connection(self, conn: FrameConnection) -> None:
        """A HELLO, then what it asked for: pushes until the pusher closes, or a stream; a stream the client ended
        cleanly (END, answered by OK) leaves the connection open for the client's next HELLO (its next session)."""
        try:
            if len(self.connections) > self.max_connections:
                raise Aborted(grpc.StatusCode.RESOURCE_EXHAUSTED, f"more than {self.max_connections} connections")
            purpose = await self._hello(conn, frames.HELLO_TIMEOUT_S)
            while purpose == Purpose.STREAM and await self._stream(conn):
                purpose = await self._next_hello(conn)
            if purpose == Purpose.PUSH:
                await self._pushes(conn)
        except (FrameError, Aborted) as exc:
            self.refused += isinstance(exc, FrameError)
            code, details = (exc.code, exc.details) if isinstance(exc, Aborted) else \
                (grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            await self._send_last(conn, frames.status(code, details))
        except (ConnectionError, asyncio.CancelledError):
            pass
        except Exception:  # a bug: this connection ends, the server goes on
            log.exception("framed connection failed")
        finally:
            conn.transport.close()

    async def _hello(self, conn: FrameConnection, timeout_s: float) -> Purpose | None:
        """The purpose of the HELLO that comes within `timeout_s` (None: the connection ended cleanly first), once
        its token passes a private swarm's check (every stream of a connection shows a fresh one)."""
        try:
            async with asyncio.timeout(timeout_s):
                got = await conn.next_frame()
        except TimeoutError:
            raise FrameError(f"no HELLO within {timeout_s} s") from None
        if isinstance(got, FrameError):
            raise got
        if got is None:
            return None
        if got[0] != Kind.HELLO:
            raise FrameError("a connection's first frame, and the first after a stream's end, must be HELLO")
        if len(got[1]) > frames.MAX_HELLO_BYTES:
            raise FrameError(f"oversized HELLO: {len(got[1])} bytes exceed the limit of {frames.MAX_HELLO_BYTES}")
        purpose, token = frames.parse_hello(got[1])
        if self.checker is not None:
            reason = self.checker.check(INFERENCE_METHOD if purpose == Purpose.STREAM else PUSH_METHOD, token)
            if reason is not None:
                self.refused += 1
                raise Aborted(grpc.StatusCode.UNAUTHENTICATED,
                              f"this server belongs to a private swarm ({reason}): {HINT}")
        return purpose

    async def _next_hello(self, conn: FrameConnection) -> Purpose | None:
        """After a clean stream: the next HELLO, or None when the client closes or stays idle for `idle_timeout_s`
        (then the connection closes without a word: the client's kept connection is simply gone)."""
        conn.resume()  # (reading may have paused for the stream's inbox)
        try:
            async with asyncio.timeout(self.idle_timeout_s):
                await conn.wait_frame()
        except TimeoutError:
            return None
        return await self._hello(conn, frames.HELLO_TIMEOUT_S)

    async def _stream(self, conn: FrameConnection) -> bool:
        """One Inference stream: the service's own handler, fed by REQUEST frames, its replies as REPLY frames.
        True when the client ended it (END) and it ended OK: the connection may carry the next stream."""
        broken: list[FrameError] = []
        requests = FramedRequests(conn, broken)
        replies = self.service.Inference(requests, FrameContext(_peer_of(conn.transport)))
        try:
            async for reply in replies:
                conn.write(frames.frame(Kind.REPLY, reply.SerializeToString()))
                await conn.drain()
        finally:
            await replies.aclose()
        if broken:
            raise broken[0]
        await self._send_last(conn, frames.status(grpc.StatusCode.OK))
        return requests.ended and not conn.transport.is_closing()

    async def _pushes(self, conn: FrameConnection) -> None:
        """PUSH frames, each answered by one STATUS (the service's Push handler decides), until the pusher closes."""
        while True:
            got = await conn.next_frame()
            if got is None:
                return
            if isinstance(got, FrameError):
                raise got
            kind, body = got
            if kind != Kind.PUSH:
                raise FrameError(f"a {kind.name} frame on a push connection (expected PUSH)")
            context = FrameContext(_peer_of(conn.transport))
            await self.service.Push(request_of("Push", body), context)
            conn.write(frames.status(context.code, context.details))
            await conn.drain()

    @staticmethod
    async def _send_last(conn: FrameConnection, data: bytes) -> None:
        try:
            conn.write(data)
            async with asyncio.timeout(2.0):
                await conn.drain()
        except (ConnectionError, TimeoutError):
            pass
