"""A pushed hop's critical path (docs/RESULTS-hop.md round 17): the taker answers a push it took after the session's
stream task has had its turn (server/frame_server.py `_push_now`), and the client reads a pushed step's replies as
they come, a middle one kept undecoded (client/pipeline.py `run_blocking`)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import torch

from swarmlm.client.pipeline import Hop, OpenSpan, StepPipeline
from swarmlm.client.streams import HopTiming, Undecoded
from swarmlm.config import ClientConfig
from swarmlm.server.frame_server import FrameServer
from swarmlm.types import Span
from swarmlm.wire import codec, frames
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire.frames import Kind


class _Transport:
    def __init__(self, closing: bool = False) -> None:
        self.written: list[bytes] = []
        self.closing = closing

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.closing


class _Conn:
    """What `_push_now` uses of a FrameConnection."""

    def __init__(self, closing: bool = False) -> None:
        self.transport = _Transport(closing)
        self.queued: list = []

    def writable(self) -> bool:
        return not self.transport.is_closing()

    def write(self, data: bytes) -> None:
        self.transport.write(data)

    def queue(self, item) -> None:
        self.queued.append(item)


def _taker(order: list[str], code: grpc.StatusCode = grpc.StatusCode.OK) -> SimpleNamespace:
    """A FrameServer's `self` for `_push_now`: its service takes the push into an inbox, whose reader (the session's
    stream task) is woken with a callback scheduled now, as Inbox.put_nowait does."""
    def push_now(data: bytes, context) -> pb.PushReply:
        asyncio.get_running_loop().call_soon(order.append, "the session's turn")
        if code is not grpc.StatusCode.OK:
            context.set_code(code)
            context.set_details("refused")
        return pb.PushReply()
    return SimpleNamespace(service=SimpleNamespace(push_now=push_now))


def test_a_taken_push_is_answered_after_the_sessions_turn():
    async def run() -> tuple[list[str], list[bytes], list[bytes]]:
        order: list[str] = []
        conn = _Conn()
        FrameServer._push_now(_taker(order), conn, "peer", (Kind.PUSH, b""))
        before = list(conn.transport.written)
        conn.transport.write = lambda data: (order.append("answered"), conn.transport.written.append(data))
        for _ in range(3):
            await asyncio.sleep(0)
        return order, before, conn.transport.written
    order, before, written = asyncio.run(run())
    assert before == []  # nothing in front of the session's step
    assert order == ["the session's turn", "answered"] and written == [frames.OK_STATUS]


def test_a_refused_push_is_answered_at_once_and_a_closed_connection_not_at_all():
    async def run(code: grpc.StatusCode, closing: bool) -> tuple[list[bytes], list[bytes]]:
        conn = _Conn()
        FrameServer._push_now(_taker([], code), conn, "peer", (Kind.PUSH, b""))
        at_once = list(conn.transport.written)
        conn.transport.closing = closing
        for _ in range(3):
            await asyncio.sleep(0)
        return at_once, conn.transport.written
    at_once, written = asyncio.run(run(grpc.StatusCode.PERMISSION_DENIED, False))
    assert len(at_once) == 1 and written == at_once
    assert frames.parse_frame(bytearray(at_once[0]), 1 << 16)[0] == Kind.STATUS and at_once[0] != frames.OK_STATUS
    at_once, written = asyncio.run(run(grpc.StatusCode.OK, True))  # closed before its answer: none written
    assert at_once == [] and written == []


class _Stream:
    """What `run_blocking` uses of a SpanStream: each call logged in one list shared by the route's streams."""

    def __init__(self, name: str, log: list, output: torch.Tensor) -> None:
        self.name, self.log, self.output = name, log, output
        self.next_step_id = 1
        self.session_id, self.session_secret = name, b"s" * 32
        self.blocking_ok = True

    def expect(self, n_tokens: int) -> None:
        self.next_step_id += 1

    def takes_float32(self, shape) -> bool:
        return True

    def send_blocking(self, hidden, mask, timeout_s, push=(), op=None, encoded=None, shape=None) -> None:
        self.log.append(("send", self.name, len(push)))
        self.next_step_id += 1

    def receive_blocking(self, timeout_s: float, keep_undecoded: bool = False):
        self.log.append(("read", self.name, timeout_s, keep_undecoded))
        message = codec.encode(self.output)
        out = Undecoded(message, codec.checked(message, "reply hidden")) if keep_undecoded else self.output
        return out, HopTiming(self.name, 0.0, 0.0, 0.0, 0.0, 0.0, 1, pushed=keep_undecoded)


def _route(push: bool) -> tuple[StepPipeline, list]:
    log: list = []
    outputs = [torch.randn(1, 1, 8) for _ in range(3)]
    spans = []
    for n, name in enumerate(("s1", "s2", "s3")):
        span = OpenSpan(Span(name, 2 * n, 2 * n + 2, f"127.0.0.1:{n + 1}"), stream=_Stream(name, log, outputs[n]))
        span.sealed_push_key = lambda target: b""  # (unkeyed streams)
        spans.append(span)
    x = torch.randn(1, 1, 8)
    pipeline = StepPipeline([Hop(s) for s in spans], [(x, torch.ones(1, 1, dtype=torch.long))], ClientConfig(),
                            hang_timeout=lambda span, rows, tokens, cached: 1.0 + span.start, push=push)
    return pipeline, log


def test_a_pushed_steps_replies_are_read_as_they_come_a_middle_one_undecoded():
    pipeline, log = _route(push=True)
    outcome = pipeline.run_blocking()
    assert outcome.complete
    # one write (the route's first server, pushing on to the two others), then each reply in route order, each
    # bounded by the hang timeouts of the hops computed before it comes (1, 1 + 3, 1 + 3 + 5)
    assert log == [("send", "s1", 2), ("read", "s1", 1.0, True), ("read", "s2", 4.0, True),
                   ("read", "s3", 9.0, False)]
    assert [type(h.outputs[0]) for h in pipeline.hops] == [Undecoded, Undecoded, torch.Tensor]
    assert torch.equal(pipeline.hops[0].outputs[0].tensor(), pipeline.hops[0].stream.output)


def test_a_relayed_steps_replies_are_read_as_before():
    pipeline, log = _route(push=False)
    assert pipeline.run_blocking().complete
    assert log == [("send", "s1", 0), ("read", "s1", 1.0, True), ("send", "s2", 0), ("read", "s2", 3.0, True),
                   ("send", "s3", 0), ("read", "s3", 5.0, False)]
