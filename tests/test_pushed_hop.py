"""A pushed hop's critical path (docs/RESULTS-hop.md round 17): on the framed port a pushing server writes its reply
to the client before its push (server/session_stream.py), on gRPC after it; the client keeps a pushed step's middle
replies undecoded (client/pipeline.py `run_blocking`)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from swarmlm.client.frame_call import FrameCall
from swarmlm.client.pipeline import Hop, OpenSpan, StepPipeline
from swarmlm.client.streams import HopTiming, Undecoded
from swarmlm.config import ClientConfig, ServerConfig
from swarmlm.server.frame_server import FrameContext
from swarmlm.server.session_stream import SessionStreams
from swarmlm.server.sessions import PeerBytes
from swarmlm.types import BlockRange, Span
from swarmlm.wire import codec
from swarmlm.wire import swarm_pb2 as pb


class _Requests:
    """A stream's requests: one step, then nothing (the stream stays open). `feed`: the framed port's kind."""

    def __init__(self, first: pb.InferenceRequest) -> None:
        self.first = first

    def __aiter__(self):
        return self

    async def __anext__(self) -> pb.InferenceRequest:
        first, self.first = self.first, None
        if first is None:
            await asyncio.Event().wait()
        return first


class _FramedRequests(_Requests):
    async def feed(self, take_now, take) -> None:
        await asyncio.Event().wait()


def _events_of_a_pushed_step(requests_type) -> list[str]:
    """What a server's stream does with one step it pushes on: its reply yielded, its push started, in order."""
    events: list[str] = []
    session = SimpleNamespace(session_id="ab", keys=None, state=SimpleNamespace(position=0))
    x = torch.randn(1, 1, 8)

    async def run_step(session, request, context) -> pb.InferenceReply:
        return pb.InferenceReply(session_id="ab", step_id=1, hidden=codec.encode(x), pushed=True)

    sessions = SimpleNamespace(detach=lambda sid: None, close=lambda sid: None)  # (the stream's end)
    streams = SessionStreams(ServerConfig(model_dir="unused", blocks=BlockRange(0, 1)), sessions=sessions,
                             load=PeerBytes(1 << 20), pusher=None, prefixes=None, open_session=None,
                             run_step=run_step, accepting=lambda: True, refused_open=lambda n: None,
                             server_key=None)

    async def attach(first, peer, context):
        return session
    streams._attach = attach
    streams._push_after = lambda session, reply, step: events.append("push") or True
    step = pb.InferenceRequest(session_id="ab", secret=b"s" * 16, step=pb.InferenceStep(
        hidden=codec.encode(x), step_id=1, push=[pb.PushTarget(address="127.0.0.1:1", session_id="cd", step_id=1)]))

    async def run() -> None:
        replies = streams.serve(requests_type(step), FrameContext("ipv4:127.0.0.1:1"))
        reply = pb.InferenceReply.FromString(await replies.__anext__())
        events.append("reply")
        assert reply.pushed and reply.step_id == 1
        after = asyncio.ensure_future(replies.__anext__())  # (the next reply: none comes)
        for _ in range(10):
            await asyncio.sleep(0)
        after.cancel()
        with pytest.raises(asyncio.CancelledError):
            await after
        await replies.aclose()
    asyncio.run(run())
    return events


def test_a_framed_stream_writes_a_pushed_steps_reply_before_its_push():
    assert _events_of_a_pushed_step(_FramedRequests) == ["reply", "push"]


def test_a_grpc_stream_starts_a_pushed_steps_push_before_its_reply():
    assert _events_of_a_pushed_step(_Requests) == ["push", "reply"]


class _Stream:
    """What `run_blocking` uses of a SpanStream: each call logged in one list shared by the route's streams."""

    def __init__(self, name: str, log: list, output: torch.Tensor) -> None:
        self.name, self.log, self.output = name, log, output
        self.next_step_id = 1
        self.session_id, self.session_secret = name, b"s" * 32
        self.blocking_ok = True
        self.call = name

    def expect(self, shape) -> None:
        self.next_step_id += 1

    def send_blocking(self, source, mask, timeout_s, push=(), op=None, keep=False) -> None:
        self.log.append(("send", self.name, len(push)))
        self.next_step_id += 1

    def receive_blocking(self, timeout_s: float, keep_undecoded: bool = False):
        self.log.append(("read", self.name, keep_undecoded))
        message = codec.encode(self.output)
        out = Undecoded(message.data, codec.checked(message, "reply hidden")) if keep_undecoded else self.output
        return out, HopTiming(self.name, 0.0, 0.0, 0.0, 0.0, 0.0, 1, pushed=keep_undecoded)


def _route(push: bool, monkeypatch) -> tuple[StepPipeline, list]:
    log: list = []
    monkeypatch.setattr(FrameCall, "wait_last", staticmethod(lambda calls, timeout_s: log.append(("wait", *calls))))
    spans = []
    for n, name in enumerate(("s1", "s2", "s3")):
        span = OpenSpan(Span(name, 2 * n, 2 * n + 2, f"127.0.0.1:{n + 1}"),
                        stream=_Stream(name, log, torch.randn(1, 1, 8)))
        span.sealed_push_key = lambda target: b""  # (unkeyed streams)
        spans.append(span)
    x = torch.randn(1, 1, 8)
    pipeline = StepPipeline([Hop(s) for s in spans], [(x, torch.ones(1, 1, dtype=torch.long))], ClientConfig(),
                            hang_timeout=lambda span, rows, tokens, cached: 1.0, push=push)
    return pipeline, log


def test_a_pushed_steps_middle_replies_are_checked_and_kept_undecoded(monkeypatch):
    pipeline, log = _route(True, monkeypatch)
    assert pipeline.run_blocking().complete
    assert log == [("send", "s1", 2), ("wait", "s1", "s2", "s3"), ("read", "s1", True), ("read", "s2", True),
                   ("read", "s3", False)]
    assert [type(h.outputs[0]) for h in pipeline.hops] == [Undecoded, Undecoded, torch.Tensor]
    assert torch.equal(pipeline.hops[0].outputs[0].tensor(), pipeline.hops[0].stream.output)
    # the next hop's history holds its input as it came, a tensor once read (a failover's replay)
    assert torch.equal(pipeline.hops[1].open_span.history[0][0], pipeline.hops[0].stream.output)


def test_a_relayed_steps_replies_are_read_as_before(monkeypatch):
    pipeline, log = _route(False, monkeypatch)
    assert pipeline.run_blocking().complete
    assert log == [("send", "s1", 0), ("read", "s1", True), ("send", "s2", 0), ("read", "s2", True),
                   ("send", "s3", 0), ("read", "s3", False)]
