"""The framed step port (wire/frames.py): Inference streams and pushes on plain TCP, beside gRPC, served by the same
SwarmService handlers on the same event loop (a lone decode step computes inline there: the thread that computes
is the one that waits on the socket, docs/ARCHITECTURE.md).

Same trust as gRPC: a private swarm's token in the HELLO (the same check, method names and replay memory as the
gRPC interceptor's), session secrets checked by the handlers themselves. A connection that breaks the framing gets
a STATUS saying why and is closed; other connections are not affected.
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from swarmlm.config import ServerConfig
from swarmlm.server.inbound import UNPARSABLE
from swarmlm.swarm.private import HINT, TokenChecker
from swarmlm.wire import frames
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire.frames import FrameError, Kind, Purpose

log = logging.getLogger(__name__)
INFERENCE_METHOD = "/swarmlm.Swarm/Inference"  # the token of a stream: as for gRPC's Inference call
PUSH_METHOD = "/swarmlm.Swarm/Push"


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


def _peer_of(writer: asyncio.StreamWriter) -> str:
    """As gRPC names a peer ("ipv4:1.2.3.4:5678"): quotas count per host either way (server/checks.peer_host)."""
    name = writer.get_extra_info("peername")
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
        self.checker = checker  # the gRPC interceptor's: one replay memory for both transports
        self.connections: set[asyncio.Task] = set()
        self.refused = 0  # connections refused: framing, swarm key or too many
        self._server: asyncio.Server | None = None

    async def start(self, host: str) -> int:
        self._server = await asyncio.start_server(self._connection, host, 0, reuse_port=False)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self.connections):
            task.cancel()
        await asyncio.gather(*self.connections, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections.add(asyncio.current_task())
        try:
            if len(self.connections) > self.max_connections:
                raise Aborted(grpc.StatusCode.RESOURCE_EXHAUSTED, f"more than {self.max_connections} connections")
            purpose = await self._hello(reader)
            if purpose == Purpose.STREAM:
                await self._stream(reader, writer)
            else:
                await self._pushes(reader, writer)
        except (FrameError, Aborted) as exc:
            self.refused += isinstance(exc, FrameError)
            code, details = (exc.code, exc.details) if isinstance(exc, Aborted) else \
                (grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            await self._send_last(writer, frames.status(code, details))
        except (ConnectionError, asyncio.CancelledError):
            pass
        except Exception:  # a bug: this connection ends, the server goes on
            log.exception("framed connection failed")
        finally:
            self.connections.discard(asyncio.current_task())
            writer.close()

    async def _hello(self, reader: asyncio.StreamReader) -> Purpose:
        try:
            async with asyncio.timeout(frames.HELLO_TIMEOUT_S):
                got = await frames.read_frame(reader, frames.MAX_HELLO_BYTES, frames.HELLO_TIMEOUT_S)
        except TimeoutError:
            raise FrameError(f"no HELLO within {frames.HELLO_TIMEOUT_S} s") from None
        if got is None or got[0] != Kind.HELLO:
            raise FrameError("the first frame must be HELLO")
        purpose, token = frames.parse_hello(got[1])
        if self.checker is not None:
            reason = self.checker.check(INFERENCE_METHOD if purpose == Purpose.STREAM else PUSH_METHOD, token)
            if reason is not None:
                self.refused += 1
                raise Aborted(grpc.StatusCode.UNAUTHENTICATED,
                              f"this server belongs to a private swarm ({reason}): {HINT}")
        return purpose

    async def _stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One Inference stream: the service's own handler, fed by REQUEST frames, its replies as REPLY frames."""
        broken: list[FrameError] = []
        replies = self.service.Inference(self._requests(reader, broken), FrameContext(_peer_of(writer)))
        try:
            async for reply in replies:
                writer.write(frames.frame(Kind.REPLY, reply.SerializeToString()))
                await writer.drain()
        finally:
            await replies.aclose()
        if broken:
            raise broken[0]
        await self._send_last(writer, frames.status(grpc.StatusCode.OK))

    async def _requests(self, reader: asyncio.StreamReader, broken: list[FrameError]):
        """REQUEST frames as parsed InferenceRequests (UNPARSABLE when they do not parse, as on gRPC), until END.
        A framing error ends the iteration with an exception (a broken stream to the handler) and is kept in
        `broken` for the STATUS."""
        while True:
            try:
                got = await frames.read_frame(reader, self.max_body_bytes, self.body_timeout_s)
                if got is None:
                    raise ConnectionResetError("the connection ended without END")
                kind, body = got
                if kind == Kind.END:
                    return
                if kind != Kind.REQUEST:
                    raise FrameError(f"a {kind.name} frame inside a stream (expected REQUEST or END)")
            except FrameError as exc:
                broken.append(exc)
                raise
            try:
                yield pb.InferenceRequest.FromString(body)
            except Exception:  # DecodeError, or anything else a hostile byte string provokes
                yield UNPARSABLE

    async def _pushes(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """PUSH frames, each answered by one STATUS (the service's Push handler decides), until the pusher closes."""
        while True:
            got = await frames.read_frame(reader, self.max_body_bytes, self.body_timeout_s)
            if got is None:
                return
            kind, body = got
            if kind != Kind.PUSH:
                raise FrameError(f"a {kind.name} frame on a push connection (expected PUSH)")
            try:
                request = pb.PushRequest.FromString(body)
            except Exception:
                request = UNPARSABLE
            context = FrameContext(_peer_of(writer))
            await self.service.Push(request, context)
            writer.write(frames.status(context.code, context.details))
            await writer.drain()

    @staticmethod
    async def _send_last(writer: asyncio.StreamWriter, data: bytes) -> None:
        try:
            writer.write(data)
            async with asyncio.timeout(2.0):
                await writer.drain()
        except (ConnectionError, TimeoutError):
            pass
