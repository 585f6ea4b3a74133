"""Pushes over the next server's framed step port (wire/frames.py): a PUSH frame per step, answered by one STATUS,
on connections kept per target (a few idle ones each, so concurrent sessions' pushes do not wait for each other).

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

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]
InfoCall = Callable[[str, bytes], Awaitable["pb.InfoReply | None"]]  # (address, nonce) -> the target's Info or None


class FramePushes:
    def __init__(self, info: InfoCall, swarm_key: bytes | None, max_message_bytes: int,
                 port_ttl_s: float = 30.0) -> None:
        self.info = info  # the target's Info over gRPC, with a nonce to sign (Pusher.info)
        self.swarm_key = swarm_key
        self.max_message_bytes = max_message_bytes
        self.port_ttl_s = port_ttl_s
        self._ports: OrderedDict[str, tuple[int, float]] = OrderedDict()  # address -> (port or 0, until)
        self._idle: dict[str, list[Connection]] = {}

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
            for _, writer in self._idle.pop(old, []):
                writer.close()

    async def send(self, address: str, port: int, request: bytes, timeout_s: float) -> Connection:
        """Write one push (a PushRequest serialized) on a kept (or new) connection; its answer: `answer`.
        OSError / TimeoutError when the connection fails (it is dropped; the caller decides)."""
        idle = self._idle.get(address, [])
        conn = idle.pop() if idle else None
        if conn is None or conn[1].is_closing():
            host, port = frames.frame_target(address, port)
            token = make_token(self.swarm_key, PUSH_METHOD) if self.swarm_key is not None else None
            conn = await frames.connect(host, port, Purpose.PUSH, token, timeout_s)
        try:
            conn[1].write(frames.frame(Kind.PUSH, request))
            async with asyncio.timeout(timeout_s):
                await conn[1].drain()
        except BaseException:
            conn[1].close()
            raise
        return conn

    async def answer(self, address: str, conn: Connection) -> tuple[grpc.StatusCode, str]:
        """The target's status for the push written on `conn` (FrameError / OSError if the connection fails)."""
        reader, writer = conn
        try:
            got = await frames.read_frame(reader, frames.MAX_STATUS_BYTES)
            if got is None or got[0] != Kind.STATUS:
                raise FrameError("the target did not answer a push with a STATUS")
        except BaseException:
            writer.close()
            raise
        code, details = frames.parse_status(got[1])
        if code == grpc.StatusCode.OK and len(self._idle.setdefault(address, [])) < MAX_IDLE_PER_TARGET:
            self._idle[address].append(conn)
        else:
            writer.close()
        return code, details

    def forget(self, address: str) -> None:
        """The framed port did not answer: gRPC for this target until the port is asked again."""
        self._remember(address, 0, time.monotonic() + self.port_ttl_s)

    async def close(self) -> None:
        for conns in self._idle.values():
            for _, writer in conns:
                writer.close()
        self._idle.clear()
