"""Pushes over the next server's framed step port (wire/frames.py): a PUSH frame per step, answered by one STATUS, or
a compact PUSH_STEP (wire/compact.py), answered only if refused (a REFUSED naming its step), on connections kept per
target (a few idle ones each, so concurrent sessions' pushes do not wait for each other).

A connection is a `PushConnection` (an asyncio Protocol): `write` puts a push on the wire from the caller's own
path (no task, no await: server/push.py writes a decode step's push this way right after the forward) and its
STATUS is read where it arrives (`data_received` calls the push's callback), so a push costs its pusher no task, no
stream reader and no `asyncio.timeout`s: each Python call right after a forward costs ~10-30x its warm time
(docs/RESULTS-hop.md round 15, round 16 "A pushed step's cost").

Where the port comes from: the target's own Info, asked with a fresh nonce once per `port_ttl_s` and taken only when
it passes the connect check (swarm/identity.py: the port is among the fields the target signs over our nonce), never
from the client's message. A target without a signed port, or whose port does not answer, is pushed to with gRPC
(server/push.py)."""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Awaitable, Callable

import grpc

from swarmlm.swarm.identity import new_nonce, verify_info
from swarmlm.swarm.private import make_token
from swarmlm.wire import frames
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire.channel import is_p2p_address
from swarmlm.wire.frames import PUSH_METHOD, FrameError, Kind, Purpose

MAX_IDLE_PER_TARGET = 4  # idle connections kept per target
MAX_TARGETS = 64  # targets with a known port or idle connections (least recently used forgotten first)

InfoCall = Callable[[str, bytes], Awaitable["pb.InfoReply | None"]]  # (address, nonce) -> the target's Info or None
Answered = Callable[["PushConnection", "grpc.StatusCode | None", str], None]  # code None: no answer (broken, late)


Refused = Callable[[int, grpc.StatusCode, str], None]  # (step id, code, details): a PUSH_STEP refused (REFUSED)


class PushConnection(asyncio.Protocol):
    """One connection to a target's framed port: one push at a time, its STATUS read as it arrives; a PUSH_STEP is
    not answered unless refused (its REFUSED goes to `refused`, whenever it comes)."""

    def __init__(self, refused: Refused | None = None) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.refused = refused
        self._answered: Answered | None = None  # the push in flight's callback
        self._timer: asyncio.TimerHandle | None = None  # its deadline
        self.broken = False  # lost, timed out or answered with something else than one STATUS: not used again

    def usable(self) -> bool:
        return not self.broken and self._answered is None and not self.transport.is_closing()

    def write(self, frame: bytes, timeout_s: float, answered: Answered) -> None:
        """Write one push (a whole PUSH or PUSH_STEP frame); `answered(self, code, details)` once its STATUS comes
        (code None: none within `timeout_s`, or the connection broke: then it is closed)."""
        self._answered = answered
        self._timer = asyncio.get_running_loop().call_later(timeout_s, self._fail, "no answer in time")
        self.transport.write(frame)

    def write_unanswered(self, frame: bytes) -> None:
        """Write one PUSH_STEP frame: nothing to wait for (a refusal comes as a REFUSED, to `refused`); the
        connection is free for the next push at once."""
        self.transport.write(frame)

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if data == frames.OK_STATUS and not self.buf and self._answered is not None:  # the usual answer, whole
            return self._done(grpc.StatusCode.OK, "")
        self.buf += data
        while self.buf:
            try:
                got = frames.parse_frame(self.buf, frames.MAX_STATUS_BYTES)
                if got is not None and got[0] == Kind.REFUSED:  # an earlier PUSH_STEP's refusal
                    if self.refused is not None:
                        self.refused(*frames.parse_refused(got[1]))
                    continue
            except FrameError as exc:
                return self._fail(str(exc))
            if got is None:
                return
            if got[0] != Kind.STATUS or self.buf or self._answered is None:
                return self._fail("the target did not answer a push with one STATUS")
            code, details = frames.parse_status(got[1])
            self._done(code, details)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail("the connection was lost")

    def _fail(self, why: str) -> None:
        self.broken = True
        if self.transport is not None:
            self.transport.close()
        self._done(None, why)

    def _done(self, code: grpc.StatusCode | None, details: str) -> None:
        answered, self._answered = self._answered, None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if answered is not None:
            answered(self, code, details)


class FramePushes:
    def __init__(self, info: InfoCall, swarm_key: bytes | None, max_message_bytes: int,
                 port_ttl_s: float = 30.0, refused: Refused | None = None) -> None:
        self.info = info  # the target's Info over gRPC, with a nonce to sign (Pusher.info)
        self.refused = refused  # told of every refused PUSH_STEP (Pusher: counted, logged)
        self.swarm_key = swarm_key
        self.max_message_bytes = max_message_bytes
        self.port_ttl_s = port_ttl_s
        self._ports: OrderedDict[str, tuple[int, float]] = OrderedDict()  # address -> (port or 0, until)
        self._idle: dict[str, list[PushConnection]] = {}

    def known_port(self, address: str) -> int | None:
        """The target's framed port if known and fresh (0: none, push with gRPC); None: ask `port`."""
        known = self._ports.get(address)
        return known[0] if known is not None and known[1] > time.monotonic() else None

    async def port(self, address: str) -> int:
        """The target's framed port (0: none, push with gRPC)."""
        if is_p2p_address(address):  # relayed: gRPC through the relay only
            return 0
        now = time.monotonic()
        known = self._ports.get(address)
        if known is not None and known[1] > now:
            self._ports.move_to_end(address)
            return known[0]
        port = await self._signed_port(address)
        self._remember(address, port, now + self.port_ttl_s)
        return port

    async def _signed_port(self, address: str) -> int:
        """The framed port the target signs in its connect check (0: no Info, no valid signature, or no port)."""
        nonce = new_nonce()
        reply = await self.info(address, nonce)
        if reply is None or verify_info(reply, nonce) is not None:
            return 0
        return reply.frame_port if 0 < reply.frame_port < 65536 else 0

    def _remember(self, address: str, port: int, until: float) -> None:
        self._ports[address] = (port, until)
        self._ports.move_to_end(address)
        while len(self._ports) > MAX_TARGETS:
            old, _ = self._ports.popitem(last=False)
            for conn in self._idle.pop(old, []):
                conn.transport.close()

    def idle(self, address: str) -> PushConnection | None:
        """A kept connection to `address` free for a push now, or None."""
        idle = self._idle.get(address)
        while idle:
            conn = idle.pop()
            if conn.usable():
                return conn
            conn.transport.close()
        return None

    async def connect(self, address: str, port: int, timeout_s: float) -> PushConnection:
        """A new connection to the target's framed port, its HELLO written. OSError / TimeoutError if it fails."""
        host, port = frames.frame_target(address, port)
        token = make_token(self.swarm_key, PUSH_METHOD) if self.swarm_key is not None else None
        async with asyncio.timeout(timeout_s):
            _, conn = await asyncio.get_running_loop().create_connection(
                lambda: PushConnection(self.refused), host, port)
        conn.transport.write(frames.hello(Purpose.PUSH, token))
        return conn

    def keep(self, address: str, conn: PushConnection) -> None:
        """`conn` answered OK: kept for the next push to `address` (closed if enough are kept)."""
        idle = self._idle.setdefault(address, [])
        if len(idle) < MAX_IDLE_PER_TARGET and conn.usable():
            idle.append(conn)
        else:
            conn.transport.close()

    def forget(self, address: str) -> None:
        """The framed port did not answer: gRPC for this target until the port is asked again."""
        self._remember(address, 0, time.monotonic() + self.port_ttl_s)

    async def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.transport.close()
        self._idle.clear()
