"""The client's messages on the framed blocking path (client/streams.py): a step's request is serialized once with its
MAC (`session_keys.signed_bytes`), a reply's MAC is checked on the bytes that came (`verified_bytes`), and a changed
byte anywhere in a reply is still refused as tampering."""
from __future__ import annotations

import pytest
import torch

from swarmlm.client.streams import SpanStream, _Sent
from swarmlm.errors import ServerTampered
from swarmlm.types import Span, StepKind
from swarmlm.wire import codec, session_keys
from swarmlm.wire import swarm_pb2 as pb


class _Link:  # the link scheduler's part a blocking write touches
    in_flight = 0

    def written_outside(self, kind: StepKind) -> None:
        pass


class _Channels:  # float32 on the wire, as on loopback
    def wire_dtype_for(self, address: str, size_bytes: int) -> str:
        return "float32"


class _Call:  # a framed call that keeps what is written
    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write_blocking(self, data: bytes, timeout_s: float) -> None:
        self.written.append(data)


def _stream() -> tuple[SpanStream, session_keys.SessionKeys]:
    server = session_keys.ServerKey()
    share, keys = session_keys.client_keys(server.share)
    stream = SpanStream(_Channels(), Span("server-a", 0, 2, "127.0.0.1:1"), timeout_s=1.0)
    stream.keys, stream.session_id, stream.call, stream._link = keys, "s1", _Call(), _Link()
    return stream, keys


def _no_reserialized_mac(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a MAC over the message serialized again")

    monkeypatch.setattr(session_keys, "mac", refuse)


def test_a_blocking_step_is_written_as_its_signed_bytes_serialized_once(monkeypatch):
    stream, keys = _stream()
    _no_reserialized_mac(monkeypatch)
    hidden = torch.randn(1, 1, 8)
    stream.send_blocking(hidden, None, 1.0)
    [data] = stream.call.written
    request = pb.InferenceRequest.FromString(data)
    assert session_keys.verified_bytes(keys.client, "s1", request, data)
    assert request.step.step_id == 1 and torch.equal(codec.decode(request.step.hidden), hidden)
    assert not request.step.HasField("attention_mask") or not codec.is_set(request.step.attention_mask)


def _reply_bytes(keys: session_keys.SessionKeys, out: torch.Tensor) -> bytes:
    reply = pb.InferenceReply(hidden=codec.encode(out), step_id=1, position=1)
    return session_keys.signed_bytes(keys.server, "s1", reply)


def _expect_step(stream: SpanStream) -> None:
    stream._step_id = 1
    stream._pending.append(_Sent(StepKind.DECODE, 1, 0, 0.0, clean=False, on_link=False, step_id=1))


def test_a_reply_is_checked_on_its_bytes_and_every_changed_byte_is_refused(monkeypatch):
    stream, keys = _stream()
    out = torch.randn(1, 1, 8)
    data = _reply_bytes(keys, out)
    with monkeypatch.context() as patched:
        _no_reserialized_mac(patched)
        _expect_step(stream)
        got, _ = stream._answer(pb.InferenceReply.FromString(data), 0.0, data)
    assert torch.equal(got, out)
    refused = 0
    for i in range(len(data)):
        changed = bytearray(data)
        changed[i] ^= 0x01
        try:
            reply = pb.InferenceReply.FromString(bytes(changed))
        except Exception:  # (the framed call refuses it before: FrameCall._take)
            continue
        _expect_step(stream)
        with pytest.raises(ServerTampered):
            stream._answer(reply, 0.0, bytes(changed))
        stream._pending.clear()
        refused += 1
    assert refused > len(data) // 2


def test_a_transport_without_the_bytes_checks_the_reply_reserialized():
    """gRPC's replies come parsed: `_answer` without bytes checks the MAC the old way, with the same verdicts."""
    stream, keys = _stream()
    out = torch.randn(1, 1, 8)
    data = _reply_bytes(keys, out)
    _expect_step(stream)
    got, _ = stream._answer(pb.InferenceReply.FromString(data), 0.0)
    assert torch.equal(got, out)
    changed = pb.InferenceReply.FromString(data)
    changed.position = 2
    _expect_step(stream)
    with pytest.raises(ServerTampered):
        stream._answer(changed, 0.0)
