"""A framed connection's two halves for server/frame_server.py: the bytes cut into frames as they arrive
(`FrameConnection`, an asyncio Protocol: flow control, stalls, the end), and a stream's REQUEST (and compact STEP)
frames as the service's request iterator (`FramedRequests`: straight into the session's inbox, no reader task in
between)."""
from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from typing import Awaitable, Callable

from swarmlm.server.inbound import request_of
from swarmlm.server.lane import StepLane
from swarmlm.wire import frames
from swarmlm.wire.compact import CompactStep
from swarmlm.wire.frames import FrameError, Kind

log = logging.getLogger(__name__)


Frame = tuple[Kind, bytes]
Item = Frame | FrameError | None  # what a connection yields: a frame, why it broke, or None (a clean end)


class FrameConnection(asyncio.Protocol):
    """One framed connection: its bytes cut into frames as they arrive. Frames wait in `queued` for `next_frame`
    (the HELLO, a stream's first request, pushes) until a `sink` takes each one as it is cut (a stream's requests).
    After a broken frame or the end, nothing more is read."""

    def __init__(self, server) -> None:
        self.server = server  # server/frame_server.FrameServer: its limits, and `open` for each connection
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()  # bytes read, not yet cut into frames
        self.limit = frames.MAX_HELLO_BYTES  # the next frame's size limit (the HELLO's, then max_message_bytes)
        self.queued: deque[Item] = deque()
        self.sink: Callable[[Item], None] | None = None
        self.done = False  # a broken frame or the end was seen: no more frames
        self._waiter: asyncio.Future | None = None  # next_frame's
        self._can_write: asyncio.Future | None = None  # set while the transport's write buffer is full
        self._stall: asyncio.TimerHandle | None = None  # a begun frame's deadline
        self.peer_ended = False  # the peer's EOF came: nothing more will arrive
        self._discard_bytes: int | None = None  # closing by `close_gently`: bytes it still discards (None: not)
        self._linger: asyncio.TimerHandle | None = None  # close_gently's bound in time

    # an armed step lane of the stream's session (server/lane.py): its thread reads the socket while this is set
    # (the loop reads nothing: `arm`), until `lane_stopped` hands back what it read and did not take
    lane: StepLane | None = None

    # ---- bytes in -------------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.server.open(self)

    def data_received(self, data: bytes) -> None:
        if self._discard_bytes is not None:
            self._discard_bytes -= len(data)
            if self._discard_bytes < 0:  # a peer that keeps sending after the last word: cut off
                self.transport.abort()
            return
        if self.done:
            return
        self.buf += data
        try:
            while self.buf and not self.done and (got := frames.parse_frame(self.buf, self.limit)) is not None:
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

    # ---- the step lane -----------------------------------------------------------------------------------------
    def may_arm(self) -> bool:
        """May a step lane take this connection's reads now: none armed, nothing read and not yet taken, nothing
        queued or unsent, reading not paused?"""
        transport = self.transport
        return (self.lane is None and not self.buf and not self.queued and not self.done and self.writable()
                and transport.get_write_buffer_size() == 0 and transport.is_reading())

    def may_answer(self) -> bool:
        """May a step lane that reads another connection write its ANSWERs here now: none armed here, nothing
        unsent?"""
        return self.lane is None and not self.done and self.writable() and \
            self.transport.get_write_buffer_size() == 0

    def arm(self, lane: StepLane, answer_conn: "FrameConnection | None" = None) -> None:
        """The socket's reads are `lane`'s thread's from now (`may_arm` held); its ANSWERs go to `answer_conn` if
        given (`may_answer` held: a lane that reads pushes answers on the session's stream)."""
        self.transport.pause_reading()
        self.lane = lane
        try:
            lane.start(self, self.transport.get_extra_info("socket").fileno(), answer_conn)
        except OSError as exc:  # (out of descriptors: the usual path goes on, nothing changed)
            log.warning("no step lane: %s", exc)
            self.lane = None
            lane.disarm()
            self.resume()

    def drop_lane(self) -> None:
        """Back to the usual path for every byte (the lane's state written back first)."""
        if self.lane is not None:
            self.lane.disarm()

    def lane_stopped(self, lane: StepLane, read: bytes, unsent: bytes) -> None:
        """`lane`'s thread stopped (its `disarm`): the part of an ANSWER it did not send is written now (before
        anything else can be); the bytes it `read` and did not take are the usual path's, as if just received, and
        reading goes on, both once the caller is done (no frame is handled inside whatever disarmed the lane)."""
        if unsent and not self.transport.is_closing():
            self.transport.write(unsent)
        asyncio.get_running_loop().call_soon(self._after_lane, lane, read)

    def _after_lane(self, lane: StepLane, read: bytes) -> None:
        if self.lane is not lane:
            return
        self.lane = None
        if self.transport.is_closing():
            return
        self.resume()
        if read:
            self.data_received(read)

    def eof_received(self) -> bool:
        self.drop_lane()
        self.peer_ended = True
        if self._discard_bytes is not None:
            return False  # closing gently: the peer is done too, the transport closes
        if not self.done:
            self._put(self._truncated() if self.buf else None)
        return True  # keep the transport open to write the STATUS

    def connection_lost(self, exc: Exception | None) -> None:
        self.drop_lane()
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        self.server.lingering.discard(self)
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

    def queue(self, item: Item) -> None:
        """A sink hands `item` back: it and every later frame wait in `queued` (the sink is removed)."""
        self.sink = None
        self._put(item)

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
        if self.transport is not None and self.lane is None and not self.done and not self.transport.is_closing():
            self.transport.resume_reading()

    # ---- the end ------------------------------------------------------------------------------------------
    def close_gently(self, linger_s: float, max_bytes: int) -> None:
        """Close without resetting the peer: closing a TCP socket with unread input sends RST, and a peer whose
        request crossed our last frame (a refusal's STATUS) would then fail its next send and lose what it had not
        read yet. So our side ends (FIN) and the peer's bytes are read and discarded until its EOF, at most
        `linger_s` and `max_bytes` (then the connection is cut: a hostile peer holds nothing for longer)."""
        transport = self.transport
        if transport.is_closing():
            return
        if self.peer_ended or not transport.can_write_eof():
            transport.close()
            return
        self.done = True  # no more frames
        self.buf.clear()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        self._discard_bytes = max_bytes
        self.server.lingering.add(self)
        self._linger = asyncio.get_running_loop().call_later(linger_s, transport.abort)
        transport.write_eof()  # (after what is still buffered)
        transport.resume_reading()

    # ---- bytes out ------------------------------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        if self.transport.is_closing():
            raise ConnectionResetError("the connection is closed")
        self.transport.write(data)

    def writable(self) -> bool:
        """Open, and its write buffer under the transport's limit (a write now needs no `drain`)."""
        return self._can_write is None and not self.transport.is_closing()

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
    """A stream's REQUEST frames as the service's request iterator: parsed InferenceRequests (UNPARSABLE when they do
    not parse, as on gRPC), and STEP frames as `CompactStep`s (wire/compact.py), until END. A broken frame ends it with
    the FrameError (kept in `broken` for the STATUS); a connection that ends without END, with ConnectionResetError. The
    service reads the first request with `__anext__`, then lets `feed` put the rest into the session's inbox as they
    arrive."""

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
        if kind == Kind.STEP:  # a compact decode step (wire/compact.py): checked by the session's stream and step
            return CompactStep(body)
        if kind != Kind.REQUEST:
            self.broken.append(FrameError(f"a {kind.name} frame inside a stream (expected REQUEST, STEP or END)"))
            raise self.broken[-1]
        return request_of("Inference", body)

    async def feed(self, take_now: Callable[[object, bytes], bool],
                   take: Callable[[object, bytes], Awaitable[None]]) -> None:
        """Every later request into the session's inbox: `take_now` (in data_received: the inbox and the peer's
        bytes have room now, else nothing is done) as each frame is cut; while that fails, reading pauses and this
        task `take`s the waiting frames in order (which waits for room). Both get the request and the bytes it was
        parsed from (its MAC is checked on them). Returns at END; raises as __anext__."""
        conn = self.conn
        self._feeding = asyncio.current_task()
        self._pending.extend(conn.queued)
        conn.queued.clear()
        conn.sink = functools.partial(self._arrived, take_now=take_now)
        try:
            while True:
                self._slow = bool(self._pending)
                while self._pending:
                    item = self._pending.popleft()
                    try:
                        request = self._request(item)
                    except StopAsyncIteration:  # frames after END are the connection's: its next HELLO...
                        conn.queued.extendleft(reversed(self._pending))
                        self._pending.clear()
                        return
                    await take(request, item[1])
                self._slow = False
                conn.resume()
                self._wake = asyncio.get_running_loop().create_future()
                await self._wake
        finally:
            conn.sink = None

    def _arrived(self, item: Item, take_now: Callable[[object], bool]) -> None:
        if self._feeding.cancelling():  # the stream ended (its bytes in flight released): nothing more goes in
            return
        if not self._slow and isinstance(item, tuple) and (item[0] == Kind.STEP or item[0] == Kind.REQUEST):
            try:
                if take_now(self._request(item), item[1]):
                    return
            except Exception:  # (a bug: the stream ends, as a broken reader's would)
                log.exception("a framed request could not be queued")
                item = FrameError("the server could not queue the request")
        self._pending.append(item)
        self._slow = True
        self.conn.pause()
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)
