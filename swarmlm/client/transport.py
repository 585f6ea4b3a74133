"""The client's side of the wire: one background event loop, cached gRPC channels, and span streams."""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

import grpc
import torch

from swarmlm.errors import InvalidRequest, ServerFailed
from swarmlm.types import Span
from swarmlm.wire import codec
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire import swarm_pb2_grpc as pb_grpc

T = TypeVar("T")


class LoopThread:
    """An asyncio loop on a daemon thread; sync code submits coroutines to it."""

    _instance: "LoopThread | None" = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
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
    """One grpc.aio channel per address, created on the loop thread."""

    def __init__(self, max_message_bytes: int) -> None:
        self.max_message_bytes = max_message_bytes
        self._stubs: dict[str, pb_grpc.SwarmStub] = {}

    def stub(self, address: str) -> pb_grpc.SwarmStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = grpc.aio.insecure_channel(address, options=[
                ("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.max_send_message_length", self.max_message_bytes),
            ])
            stub = self._stubs[address] = pb_grpc.SwarmStub(channel)
        return stub


@dataclass
class HopTiming:
    """One step through one span, seen from both ends."""

    server_id: str
    wall_s: float  # client: request written -> reply parsed
    queued_s: float  # server: waiting for the compute thread
    compute_s: float  # server: running the blocks
    server_io_s: float  # server: parsing + validating + serialising
    client_io_s: float  # client: serialising the request + parsing the reply
    tokens: int

    @property
    def network_s(self) -> float:
        """What is left of the wall time: transfer, gRPC and event-loop overheads."""
        return max(self.wall_s - self.queued_s - self.compute_s - self.server_io_s, 0.0)


def _failed(span: Span, exc: BaseException) -> ServerFailed:
    if isinstance(exc, grpc.aio.AioRpcError):
        return ServerFailed(span.server_id, f"{exc.code().name}: {exc.details()}")
    return ServerFailed(span.server_id, f"{type(exc).__name__}: {exc}")


class SpanStream:
    """A session on one server: an open bidirectional stream; steps go in order."""

    def __init__(self, channels: Channels, span: Span, timeout_s: float) -> None:
        self.channels = channels
        self.span = span
        self.timeout_s = timeout_s
        self.call = None
        self.session_id = ""
        self.position = 0
        self._step_id = 0

    async def open(self, batch: int, max_length: int) -> None:
        try:
            self.call = self.channels.stub(self.span.address).Inference()
            await self.call.write(pb.InferenceRequest(open=pb.OpenSession(
                start_block=self.span.start, end_block=self.span.end, batch_size=batch, max_length=max_length)))
            reply = await asyncio.wait_for(self.call.read(), self.timeout_s)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, OSError) as exc:
            await self.close()
            raise _failed(self.span, exc) from exc
        if reply is grpc.aio.EOF:
            raise ServerFailed(self.span.server_id, "stream closed while opening a session")
        self.session_id = reply.session_id

    async def step(self, hidden: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, HopTiming]:
        t0 = time.perf_counter()
        self._step_id += 1
        request = pb.InferenceRequest(step=pb.InferenceStep(
            hidden=codec.encode(hidden), step_id=self._step_id,
            attention_mask=codec.encode(mask) if mask is not None else pb.Tensor()))
        t1 = time.perf_counter()
        try:
            await self.call.write(request)
            reply = await asyncio.wait_for(self.call.read(), self.timeout_s)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, OSError, asyncio.InvalidStateError) as exc:
            raise _failed(self.span, exc) from exc
        t2 = time.perf_counter()
        if reply is grpc.aio.EOF:
            raise ServerFailed(self.span.server_id, "stream closed by the server")
        if reply.HasField("error"):
            raise InvalidRequest(f"{self.span.server_id}: {reply.error.message}")
        out = codec.decode(reply.hidden, "reply hidden")
        t3 = time.perf_counter()
        self.position = reply.position
        tm = reply.timing
        return out, HopTiming(
            self.span.server_id, wall_s=t2 - t1, queued_s=tm.queued_s, compute_s=tm.compute_s,
            server_io_s=tm.decode_s + tm.encode_s, client_io_s=(t1 - t0) + (t3 - t2), tokens=hidden.shape[1],
        )

    async def close(self) -> None:
        if self.call is not None:
            try:
                await self.call.done_writing()  # a clean end: the server closes the session now
                await asyncio.wait_for(self.call.read(), 2.0)  # its end of stream
            except Exception:
                pass  # already broken: the server expires the session on its own
            self.call.cancel()
            self.call = None


async def info(channels: Channels, address: str, timeout_s: float = 5.0) -> tuple[pb.InfoReply, float]:
    """The server's info and the round trip of asking for it."""
    t0 = time.perf_counter()
    reply = await channels.stub(address).Info(pb.InfoRequest(), timeout=timeout_s)
    return reply, time.perf_counter() - t0
