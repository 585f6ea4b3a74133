"""The framed step port (wire/frames.py): Inference streams and pushes on plain TCP, beside gRPC, served by the same
SwarmService handlers on the same event loop (a lone decode step computes inline there: the thread that computes
is the one that waits on the socket, docs/ARCHITECTURE.md).

Frames are cut from the bytes as they arrive (`FrameConnection.data_received`, on the loop, server/frame_conn.py).
A stream's requests go from there straight into its session's inbox (`FramedRequests.feed`): no reader task between
the socket and the step, so a decode step costs the loop one wake-up, not two. When the inbox or the peer's bytes in
flight are full, reading pauses until there is room (as HTTP/2 flow control holds a gRPC client back). A connection
carries one stream after another: after a stream its client ended cleanly it waits for the next HELLO.

Same trust as gRPC: a private swarm's token in the HELLO (the same check, method names and replay memory as the
gRPC interceptor's), session secrets checked by the handlers themselves. A connection that breaks the framing gets
a STATUS saying why and is closed; other connections are not affected.
"""
from __future__ import annotations

import asyncio
import functools
import logging

import grpc

from swarmlm.config import ServerConfig
from swarmlm.server.frame_conn import FrameConnection, FramedRequests
from swarmlm.server.inbound import request_of
from swarmlm.swarm.private import HINT, TokenChecker
from swarmlm.wire import frames
from swarmlm.wire.compact import AnswerFrame, PushStep
from swarmlm.wire.frames import INFERENCE_METHOD, PUSH_METHOD, FrameError, Kind, Purpose

log = logging.getLogger(__name__)

# a closing connection reads (and discards) its peer's last bytes this long and this many at most (close_gently):
# enough for a request that crossed a refusal (a bigger one is cut: its client still reads the STATUS)
LINGER_S = 2.0
LINGER_BYTES = 1 << 20


def _push_of(kind: Kind, body: bytes, conn: FrameConnection | None = None):
    """A push frame's request: a PUSH's PushRequest (UNPARSABLE if it does not parse), a PUSH_STEP's `PushStep`
    (`via` its connection: a step lane may take the next ones there)."""
    return PushStep(body, conn) if kind == Kind.PUSH_STEP else request_of("Push", body)


def _answer_push(conn: FrameConnection, request, context: "FrameContext") -> None:
    """A push's answer: a PUSH's STATUS, always; a PUSH_STEP's only if it was refused (REFUSED, naming its step:
    its pusher does not wait for an answer, docs/PROTOCOL.md "Compact pushes")."""
    ok = context.code is grpc.StatusCode.OK
    if type(request) is PushStep:
        if not ok:
            conn.write(frames.refused(request.step_id, context.code, context.details))
    else:
        conn.write(frames.OK_STATUS if ok else frames.status(context.code, context.details))


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


class FrameServer:
    def __init__(self, service, config: ServerConfig, checker: TokenChecker | None) -> None:
        self.service = service  # server/service.SwarmService
        self.max_body_bytes = config.max_message_bytes
        self.body_timeout_s = config.session_idle_timeout_s  # a begun frame that stalls this long ends its stream
        self.max_connections = config.max_concurrent_rpcs  # as gRPC's limit on concurrent calls
        self.idle_timeout_s = config.frame_idle_timeout_s  # a connection between streams waits this long for a HELLO
        self.checker = checker  # the gRPC interceptor's: one replay memory for both transports
        self.connections: set[asyncio.Task] = set()
        # connections between streams, waiting for their client's next one (oldest first): closed to make room when a
        # new connection finds the server full, so kept connections never keep anyone out
        self.idle: dict[FrameConnection, None] = {}
        self.refused = 0  # connections refused: framing, swarm key or too many
        # connections closing gently (FrameConnection.close_gently): no longer counted as connections, each cut
        # after LINGER_S; when as many linger as connections may be open, the next closes at once
        self.lingering: set[FrameConnection] = set()
        self.linger_s, self.linger_bytes = LINGER_S, LINGER_BYTES
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
        for conn in list(self.lingering):
            conn.transport.abort()

    def open(self, conn: FrameConnection) -> None:
        task = asyncio.ensure_future(self._connection(conn))
        self.connections.add(task)
        task.add_done_callback(self.connections.discard)

    async def _connection(self, conn: FrameConnection) -> None:
        """A HELLO, then what it asked for: pushes until the pusher closes, or a stream; a stream the client ended
        cleanly (END, answered by OK) leaves the connection open for the client's next HELLO (its next session)."""
        gently = True  # unless the server is stopping
        try:
            if len(self.connections) > self.max_connections and not self._close_oldest_idle():
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
        except ConnectionError:
            pass
        except asyncio.CancelledError:
            gently = False
        except Exception:  # a bug: this connection ends, the server goes on
            log.exception("framed connection failed")
        finally:
            if gently and len(self.lingering) < self.max_connections:
                conn.close_gently(self.linger_s, self.linger_bytes)
            else:
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
        self.idle[conn] = None
        try:
            async with asyncio.timeout(self.idle_timeout_s):
                await conn.wait_frame()
        except TimeoutError:
            return None
        finally:
            self.idle.pop(conn, None)
        return await self._hello(conn, frames.HELLO_TIMEOUT_S)

    def _close_oldest_idle(self) -> bool:
        """Close the connection idle the longest (its client takes a new one next time); False if none is."""
        if not self.idle:
            return False
        oldest = next(iter(self.idle))
        del self.idle[oldest]
        oldest.transport.close()
        return True

    async def _stream(self, conn: FrameConnection) -> bool:
        """One Inference stream: the service's own handler, fed by REQUEST (and STEP) frames, its replies as REPLY
        (and ANSWER) frames.
        True when the client ended it (END) and it ended OK: the connection may carry the next stream."""
        broken: list[FrameError] = []
        requests = FramedRequests(conn, broken)
        replies = self.service.Inference(requests, FrameContext(_peer_of(conn.transport)))
        try:
            async for reply in replies:  # (serialized by the handler: server/session_stream.py)
                # (a compact STEP's ANSWER is a whole frame already: wire/compact.py)
                conn.write(reply if type(reply) is AnswerFrame else frames.frame(Kind.REPLY, reply))
                await conn.drain()
        finally:
            await replies.aclose()
        if broken:
            raise broken[0]
        await self._send_last(conn, frames.status(grpc.StatusCode.OK))
        return requests.ended and not conn.transport.is_closing()

    async def _pushes(self, conn: FrameConnection) -> None:
        """PUSH frames, each answered by one STATUS, and compact PUSH_STEP frames (wire/compact.py), answered only if
        refused (`_answer_push`; the service's Push handler decides), until the pusher closes. While nothing waits
        here, each push is taken as its frame is cut (`_push_now`, in data_received: no task between the socket and
        the session's inbox); one that would wait (a full inbox, a full write buffer), and
        every frame after it, go through this task in order."""
        peer = _peer_of(conn.transport)
        take_now = functools.partial(self._push_now, conn, peer)
        try:
            while True:
                if not conn.queued:
                    conn.sink = take_now
                got = await conn.next_frame()
                if got is None:
                    return
                if isinstance(got, FrameError):
                    raise got
                kind, body = got
                if kind != Kind.PUSH and kind != Kind.PUSH_STEP:
                    raise FrameError(f"a {kind.name} frame on a push connection (expected PUSH or PUSH_STEP)")
                context = FrameContext(peer)
                request = _push_of(kind, body, conn)
                await self.service.Push(request, context, None if type(request) is PushStep else body)
                _answer_push(conn, request, context)
                await conn.drain()
        finally:
            conn.sink = None

    def _push_now(self, conn: FrameConnection, peer: str, item) -> None:
        """A frame of a push connection as it is cut: a push the service takes now is answered now; anything else
        (another frame, the end, a push that would wait) goes to `_pushes`, with every frame after it."""
        if isinstance(item, tuple) and (item[0] == Kind.PUSH_STEP or item[0] == Kind.PUSH) and conn.writable():
            context = FrameContext(peer)
            request = _push_of(*item, conn)
            if self.service.push_now(request, None if type(request) is PushStep else item[1], context) is not None:
                _answer_push(conn, request, context)
                return
        conn.queue(item)

    @staticmethod
    async def _send_last(conn: FrameConnection, data: bytes) -> None:
        try:
            conn.write(data)
            async with asyncio.timeout(2.0):
                await conn.drain()
        except (ConnectionError, TimeoutError):
            pass
