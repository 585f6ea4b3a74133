"""An Inference stream over the framed step port (wire/frames.py), with the interface SpanStream uses of a grpc.aio
stream call (write, read, done_writing, cancel) and gRPC's errors (AioRpcError with a status code), so failover,
push, speculation and chunked prefill run unchanged on either transport.

One non-blocking socket, two ways to use it, never at once: from the client's event loop (`write`, `read`:
loop.sock_sendall / sock_recv), or from the caller's own thread (`write_blocking`, `read_blocking`: the thread
that wants the reply writes the frame and sleeps in poll() on the socket until it comes, no hand-off to the loop
thread and back). The session uses the blocking pair only for a decode step with nothing else of its own in flight
(session.py), so the two never overlap on one call.

A connection outlives its stream: after the server's OK for a stream this client ended (END), nothing more is in
flight either way, and client/channels.py keeps the socket for the next session to that server, which starts with
a HELLO of its own (a fresh swarm-key token: every stream is authenticated as a new connection's would be)."""
from __future__ import annotations

import asyncio
import select
import socket
import time

import grpc

from swarmlm.swarm.private import make_token
from swarmlm.wire import compact, frames
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire.frames import INFERENCE_METHOD, FrameError, Kind, Purpose

RECV_BYTES = 1 << 16  # read up to this much per recv (a decode reply is one recv)


def _frame_of(request: pb.InferenceRequest | bytes) -> bytes:
    """A request's frame: a compact STEP is one already (bytes); an InferenceRequest goes in a REQUEST frame."""
    return request if type(request) is bytes else frames.frame(Kind.REQUEST, request.SerializeToString())


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class FrameCall:
    """One Inference stream on a connection (a new one, or one an earlier stream ended cleanly: `reused`). Reads give
    InferenceReplies (or a compact STEP's `compact.Answer`, unchecked: the stream checks it), then grpc.aio.EOF at the
    server's OK, or raise AioRpcError with the server's status (or UNAVAILABLE when the connection breaks)."""

    def __init__(self, sock: socket.socket, max_message_bytes: int, reused: bool = False) -> None:
        self._sock = sock  # non-blocking, TCP_NODELAY
        self.reused = reused
        self._buf = bytearray()  # bytes read, not yet taken as frames
        self._max = max_message_bytes
        self._status: tuple[grpc.StatusCode, str] | None = None  # the stream's end, once read
        self._writing_done = False
        self._closed = False
        self._peer_closed = False  # the server closed its side
        self._pollers: dict[int, select.poll] = {}  # event -> a poller of this socket for it (_wait)

    @classmethod
    async def open(cls, host: str, port: int, swarm_key: bytes | None, max_message_bytes: int,
                   timeout_s: float, idle: socket.socket | None = None) -> "FrameCall":
        """A stream, its HELLO written: on `idle` (a connection an earlier stream ended cleanly) or a new
        connection. OSError or TimeoutError if it fails (`idle` is then closed)."""
        loop = asyncio.get_running_loop()
        token = make_token(swarm_key, INFERENCE_METHOD) if swarm_key is not None else None
        sock = idle
        try:
            async with asyncio.timeout(timeout_s):
                if sock is None:
                    family, kind, proto, _, address = (await loop.getaddrinfo(host, port,
                                                                              type=socket.SOCK_STREAM))[0]
                    sock = socket.socket(family, kind, proto)
                    sock.setblocking(False)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a small frame goes at once
                    await loop.sock_connect(sock, address)
                await loop.sock_sendall(sock, frames.hello(Purpose.STREAM, token))
        except BaseException:
            if sock is not None:
                sock.close()
            raise
        return cls(sock, max_message_bytes, reused=idle is not None)

    @property
    def reusable(self) -> bool:
        """Ended cleanly: this client's END written, the server's OK read, and no byte after it. Nothing is in
        flight on the connection either way, so the next stream may start on it."""
        return (not self._closed and not self._peer_closed and self._writing_done and not self._buf
                and self._status is not None and self._status[0] == grpc.StatusCode.OK)

    def detach(self) -> socket.socket:
        """The connection of a `reusable` call, for the next stream; this call is closed without closing it."""
        assert self.reusable
        self._closed = True
        return self._sock

    @property
    def blocking_ok(self) -> bool:
        """Open and usable from the caller's thread (write_blocking / read_blocking)."""
        return not self._closed and not self._writing_done and self._status is None

    # ---- from the event loop -----------------------------------------------------------------------------
    async def write(self, request: pb.InferenceRequest | bytes) -> None:
        """Write a request (`bytes`: a whole frame already, a compact STEP: wire/compact.py)."""
        self._check_writable()
        try:
            await asyncio.get_running_loop().sock_sendall(self._sock, _frame_of(request))
        except OSError as exc:
            raise self._lost(exc) from None

    async def read(self):
        """The next reply, or grpc.aio.EOF after the server's OK."""
        loop = asyncio.get_running_loop()
        while True:
            got = self._take()
            if got is not None:
                return got
            try:
                data = await loop.sock_recv(self._sock, RECV_BYTES)
            except OSError as exc:
                raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"connection lost: {exc}") from None
            self._received(data)

    async def done_writing(self) -> None:
        if self._writing_done or self._closed:
            return
        self._writing_done = True
        try:
            await asyncio.get_running_loop().sock_sendall(self._sock, frames.frame(Kind.END))
        except OSError:
            pass

    # ---- from the caller's thread ------------------------------------------------------------------------
    def write_blocking(self, request: pb.InferenceRequest | bytes, timeout_s: float) -> None:
        """As `write`, in this thread; TimeoutError if the socket takes nothing for `timeout_s`."""
        self._check_writable()
        # (a compact STEP is a whole frame already: `_frame_of`'s first case, without the call)
        view = memoryview(request if type(request) is bytes else _frame_of(request))
        try:
            while view:
                try:
                    view = view[self._sock.send(view):]
                except BlockingIOError:
                    self._wait(select.POLLOUT, timeout_s)
        except TimeoutError:  # (an OSError too: not a lost connection)
            raise
        except OSError as exc:
            raise self._lost(exc) from None

    def read_blocking(self, timeout_s: float):
        """As `read`, in this thread; TimeoutError if no whole frame comes within `timeout_s`. It sleeps in poll()
        before each recv (a decode step's reply is never there as soon as its request is written: a recv first
        would fail, and a raised BlockingIOError is one more cold call per step)."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self._take() if self._buf or self._status is not None else None  # (nothing read yet: no call)
            if got is not None:
                return got
            # (closed: the recv says so at once, as it did before any wait)
            if not self._closed and not self._ready(select.POLLIN, deadline - time.monotonic()):
                raise TimeoutError
            try:
                data = self._sock.recv(RECV_BYTES)
            except BlockingIOError:  # (woken with nothing to read after all)
                continue
            except OSError as exc:
                raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"connection lost: {exc}") from None
            if data:  # (`_received`'s common case, inline: one call fewer per reply)
                self._buf += data
            else:
                self._received(data)

    def has_frame(self) -> bool:
        """A whole frame (or the stream's end) is read already: `read_blocking` returns without waiting."""
        if self._status is not None or self._closed:
            return True
        return len(self._buf) >= frames.HEADER.size and \
            len(self._buf) >= frames.HEADER.size + frames.HEADER.unpack_from(self._buf)[0]

    def _wait(self, event: int, timeout_s: float) -> None:
        if timeout_s <= 0 or not self._ready(event, timeout_s):
            raise TimeoutError

    def _ready(self, event: int, timeout_s: float) -> bool:
        """Sleep until the socket is ready for `event` (or broken), at most `timeout_s` (at or below 0: just look)."""
        poller = self._pollers.get(event)
        if poller is None:  # (one per event, kept: a decode step's read makes none)
            poller = self._pollers[event] = select.poll()
            poller.register(self._sock, event)
        return bool(poller.poll(max(timeout_s, 0.0) * 1000))

    @staticmethod
    def wait_last(calls: list["FrameCall"], timeout_s: float) -> bool:
        """Sleep until the last call has bytes to read, or any of the others ends (a server that broke or refused
        the step), at most `timeout_s`; False on the timeout. The others' replies, coming meanwhile, do not wake the
        caller: a pushed decode step wakes its client once, for the route's last reply (they are read after it)."""
        if calls[-1].has_frame():
            return True
        poller = select.poll()
        for call in calls[:-1]:
            if call._closed:
                return True
            poller.register(call._sock, select.POLLRDHUP)  # (POLLERR and POLLHUP come anyway)
        if calls[-1]._closed:
            return True
        poller.register(calls[-1]._sock, select.POLLIN | select.POLLRDHUP)
        return bool(poller.poll(max(timeout_s, 0.0) * 1000))

    # ---- both ----------------------------------------------------------------------------------------------
    def _check_writable(self) -> None:
        if self._writing_done or self._closed:
            raise asyncio.InvalidStateError("the stream is closed for writing")

    def _lost(self, exc: OSError) -> grpc.aio.AioRpcError:
        """A write failed: the error of the server's STATUS if one came before it closed (a refusal: a full port, a
        swarm key), else UNAVAILABLE. (Bytes already received stay readable after a reset.)"""
        lost = rpc_error(grpc.StatusCode.UNAVAILABLE, f"connection lost: {exc}")
        try:
            while self._status is None and (data := self._sock.recv(RECV_BYTES)):
                self._buf += data
                while self._status is None and self._take() is not None:  # (replies nobody reads now: skipped)
                    pass
        except grpc.aio.AioRpcError as status:  # the server's STATUS, or its framing broken
            return status
        except OSError:  # (nothing more to read, or the reset itself)
            pass
        return lost

    def _received(self, data: bytes) -> None:
        if not data:  # the server closed the connection
            self._peer_closed = True
            if self._buf:
                self.cancel()
                raise rpc_error(grpc.StatusCode.INTERNAL, f"the server broke the framing: the connection ended "
                                                          f"inside a frame ({len(self._buf)} bytes of it)")
            self._status = self._status or (grpc.StatusCode.UNAVAILABLE, "the connection closed without a status")
        self._buf += data

    def _take(self):
        """The next reply from the bytes read (None: not all there yet), EOF, or the stream's error."""
        if self._status is not None:
            return self._end()
        try:
            got = frames.parse_frame(self._buf, self._max)
        except FrameError as exc:
            self.cancel()
            raise rpc_error(grpc.StatusCode.INTERNAL, f"the server broke the framing: {exc}") from None
        if got is None:
            return None
        kind, body = got
        if kind == Kind.ANSWER:  # a compact STEP's (checked by the stream, which holds the session's keys)
            return compact.Answer(body)
        if kind == Kind.REPLY:
            try:
                return pb.InferenceReply.FromString(body)
            except Exception:  # a hostile byte string
                self.cancel()
                raise rpc_error(grpc.StatusCode.INTERNAL, "a reply that does not parse") from None
        if kind == Kind.STATUS:
            self._status = frames.parse_status(body)
            return self._end()
        self.cancel()
        raise rpc_error(grpc.StatusCode.INTERNAL, f"the server sent a {kind.name} frame inside a stream")

    def _end(self):
        code, details = self._status
        if code == grpc.StatusCode.OK:
            return grpc.aio.EOF
        raise rpc_error(code, details)

    def cancel(self) -> None:
        """Close the connection (a read waiting on it, in the loop or a thread, sees it end)."""
        self._writing_done = True
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
