"""The client's connections: one background event loop, and per server address a cached grpc.aio channel, its
framed step port (and the framed connections kept between sessions), its session key share and what its link was
measured to carry (client/streams.py opens span streams on them)."""
from __future__ import annotations

import asyncio
import logging
import select
import socket
import threading
import time
from concurrent.futures import Future
from typing import Awaitable, Sequence, TypeVar

from swarmlm import event_loop
from swarmlm.client.chunking import BandwidthEstimate
from swarmlm.client.frame_call import FrameCall
from swarmlm.config import ClientConfig
from swarmlm.wire import compress, frames, session_keys
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire import swarm_pb2_grpc as pb_grpc
from swarmlm.wire.channel import aio_channel, is_p2p_address
from swarmlm.wire.links import Links, LinkScheduler, TransmissionPolicy

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_IDLE_FRAMED = 4  # framed connections kept per server between sessions (concurrent sessions each hold one)


class LoopThread:
    """An asyncio loop on a daemon thread; sync code submits coroutines to it."""

    _instance: "LoopThread | None" = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = event_loop.new_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="swarmlm-client-io", daemon=True)
        self.thread.start()

    @classmethod
    def get(cls) -> "LoopThread":
        with cls._lock:
            if cls._instance is None:
                cls._instance = LoopThread()
            return cls._instance

    def submit(self, coro: Awaitable[T]) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        return self.submit(coro).result(timeout)


class Channels:
    """Per address: one grpc.aio channel (created on the loop thread), its transmission scheduler (which message
    is written next) and what its link was measured to carry."""

    def __init__(self, config: ClientConfig, interceptors: Sequence = ()) -> None:
        self.max_message_bytes = config.max_message_bytes
        self.interceptors = interceptors  # a private swarm's token on every call (swarm/private.py)
        self.swarm_key = config.swarm_key  # (the framed port's HELLO carries the same token)
        self.connect_timeout_s = config.connect_timeout_s
        # per address: the framed step port its Info announced (wire/frames.py); 0 or absent: gRPC's Inference
        self.frame_ports: dict[str, int] = {}
        # per server id: the session key share its signed Info gave (wire/session_keys.py); sessions are keyed with it
        self.key_shares: dict[str, bytes] = {}
        self.frames = config.frames
        # per address: framed connections whose last stream ended cleanly, kept for the next session (it saves a
        # connect; and a connection that lives on is one `swarmlm bench`'s once-a-second telemetry sees)
        self._idle: dict[str, list[socket.socket]] = {}
        self._stubs: dict[str, pb_grpc.SwarmStub] = {}
        self.links = Links(TransmissionPolicy.for_client(config))
        self.assumed_bandwidth_bps = config.assumed_bandwidth_bps
        self._bandwidth: dict[str, BandwidthEstimate] = {}
        self.wire_dtype = config.wire_dtype  # hidden states' format, "auto-lossy" = per link (wire/compress.py)
        # a setting other than "auto-lossy" gives one format whatever the link: chosen once, not per message
        self._fixed_wire_dtype = compress.choose(self.wire_dtype, 0.0) if self.wire_dtype != "auto-lossy" else ""
        self.adapter = config.active_adapter or ""  # sessions open with this pre-loaded LoRA adapter

    def link(self, address: str) -> LinkScheduler:
        return self.links.get(address)

    def bandwidth(self, address: str) -> BandwidthEstimate:
        est = self._bandwidth.get(address)
        if est is None:
            est = self._bandwidth[address] = BandwidthEstimate(self.assumed_bandwidth_bps)
        return est

    def wire_dtype_for(self, address: str, float32_bytes: int | None = None) -> str:
        """The hidden states' wire format towards `address` for a message of `float32_bytes` (as float32; None: a
        large one) (wire/compress.py): fixed, or by the link's bandwidth and the message's size."""
        if self.wire_dtype != "auto-lossy":
            return self._fixed_wire_dtype  # ("auto": float32, exact)
        return compress.choose("auto-lossy", self.bandwidth(address).bandwidth_bps, address, float32_bytes)

    def note_info(self, address: str, reply: pb.InfoReply) -> None:
        """Remember the framed port a server's Info announces (relayed servers: gRPC through the relay only) and its
        session key share; only from a reply that passed the connect check (both are among the fields it signs)."""
        if self.frames and not is_p2p_address(address) and 0 < reply.frame_port < 65536:
            self.frame_ports[address] = reply.frame_port
        if len(reply.key_share) == session_keys.KEY_SHARE_BYTES:
            if len(self.key_shares) >= 4096:  # bounded: forget (and check again) rather than grow
                self.key_shares.clear()
            self.key_shares[reply.server_id] = reply.key_share

    async def open_stream(self, address: str, fresh: bool = False):
        """An Inference stream to `address`: on its framed port when it has one that answers (on a kept connection
        unless `fresh`), else a gRPC call (a framed port that does not answer is not tried again: a firewall that
        lets only gRPC's port through)."""
        port = self.frame_ports.get(address)
        if port:
            host, port = frames.frame_target(address, port)
            idle = None if fresh else self._take_idle(address)
            try:
                # (a TCP connect: a port a firewall drops is given up on in a second, not connect_timeout_s)
                return await FrameCall.open(host, port, self.swarm_key, self.max_message_bytes,
                                            min(self.connect_timeout_s, 1.0), idle=idle)
            except (OSError, asyncio.TimeoutError) as exc:
                if idle is not None:  # the kept connection broke: a new one
                    return await self.open_stream(address, fresh=True)
                log.info("framed port %s:%d of %s does not answer (%s): gRPC from now on", host, port, address, exc)
                self.frame_ports.pop(address, None)
        return self.stub(address).Inference()

    def end_stream(self, address: str, call) -> None:
        """A stream is over: a framed one that ended cleanly keeps its connection for the next session (a few per
        server), anything else is closed."""
        idle = self._idle.setdefault(address, [])
        if isinstance(call, FrameCall) and call.reusable and len(idle) < MAX_IDLE_FRAMED:
            idle.append(call.detach())
        else:
            call.cancel()

    def _take_idle(self, address: str) -> socket.socket | None:
        """A kept connection to `address` the server has not closed (nor written to) meanwhile, or None."""
        idle = self._idle.get(address, [])
        while idle:
            sock = idle.pop()
            poller = select.poll()
            poller.register(sock, select.POLLIN | select.POLLRDHUP)
            if not poller.poll(0):  # (POLLERR and POLLHUP come anyway)
                return sock
            sock.close()  # closed by the server (its idle timeout, a restart), or bytes nobody asked for
        return None

    def close_idle(self) -> None:
        """Close the kept framed connections (the client is closing; a session still open keeps its own)."""
        idle, self._idle = self._idle, {}
        for socks in idle.values():
            for sock in socks:
                sock.close()

    def stub(self, address: str) -> pb_grpc.SwarmStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = aio_channel(address, self.max_message_bytes, self.interceptors)
            stub = self._stubs[address] = pb_grpc.SwarmStub(channel)
        return stub


async def info(channels: Channels, address: str, timeout_s: float = 5.0,
               nonce: bytes = b"") -> tuple[pb.InfoReply, float]:
    """The server's info and the round trip of asking for it; with a `nonce` the server signs its reply (the
    connect check, swarm/identity.py)."""
    t0 = time.perf_counter()
    reply = await channels.stub(address).Info(pb.InfoRequest(nonce=nonce), timeout=timeout_s)
    return reply, time.perf_counter() - t0
