"""The client's per-hop path of a decode step (client/streams.py `SpanStream._request`, client/pipeline.py
`run_blocking`; docs/RESULTS-hop.md round 18, "The client's hop"): a step's wire format asked once per hop, a relayed
reply sent on as its bytes on a float32 link and encoded from its tensor on another, an ANSWER's values read as
checked, and the tokens of a relayed route unchanged."""
from __future__ import annotations

import socket
from types import SimpleNamespace

import numpy as np
import torch

from swarmlm.client.channels import Channels
from swarmlm.client.frame_call import FrameCall
from swarmlm.client.streams import SpanStream, Undecoded
from swarmlm.types import BlockRange, Span
from swarmlm.wire import compact, compress
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire.frames import HEADER
from swarmlm.wire.links import LinkScheduler, TransmissionPolicy
from tests.swarm_helpers import client_of, greedy_reference, in_process_swarm

HIDDEN = 8
KEY, SID = b"k" * 32, "s" * 32


class _Channels:
    """What `_request` asks of Channels: one link scheduler, the wire format (each question logged)."""

    def __init__(self, wire_dtype: str) -> None:
        self.wire_dtype, self.asked = wire_dtype, []
        self._link = LinkScheduler(TransmissionPolicy())

    def link(self, address: str) -> LinkScheduler:
        return self._link

    def wire_dtype_for(self, address: str, float32_bytes: int | None = None) -> str:
        self.asked.append(float32_bytes)
        return self.wire_dtype


def _stream(wire_dtype: str, pair) -> SpanStream:
    stream = SpanStream(_Channels(wire_dtype), Span("s", 0, 2, "127.0.0.1:1"), 1.0)
    stream.call = FrameCall(pair[0], 1 << 20)  # (a framed keyed stream: a decode step may go compact)
    stream.keys = SimpleNamespace(client=KEY, server=b"v" * 32)
    stream.session_id = SID
    return stream


def _relayed(values: torch.Tensor) -> Undecoded:
    """A previous hop's ANSWER, opened as the client opens it: its values a view of the frame."""
    body = compact.answer_frame(b"v" * 32, SID, 1, 1, values.numpy().tobytes(), 0.0, 0.0, 0.0, 0.0, 1)[HEADER.size:]
    answer = compact.Answer(body).opened(b"v" * 32, SID, values.numel())
    assert bytes(answer.values) == bytes(answer.data()) == values.numpy().tobytes()
    return Undecoded(answer.values, tuple(values.shape))


def test_a_relayed_reply_goes_on_as_its_bytes_on_a_float32_link_and_from_its_tensor_on_another():
    values = torch.randn(1, 1, HIDDEN)
    pair = socket.socketpair()
    try:
        stream = _stream("float32", pair)
        request, sent = stream._request(_relayed(values), None, [], None)
        assert request == compact.step_frame(KEY, SID, 1, 1, 1, HIDDEN, values.numpy().tobytes())
        assert sent.shape == (1, 1, HIDDEN) and sent.request_bytes == 4 * HIDDEN and sent.step_id == 1
        assert stream.channels.asked == [4 * HIDDEN], "the link's format asked once, for the values' float32 bytes"

        lossy = _stream("float16", pair)
        kept = _relayed(values)
        request, sent = lossy._request(kept, None, [], None)
        assert isinstance(request, pb.InferenceRequest) and sent.shape is None  # (not float32: never compact)
        assert request.step.hidden == compress.encode_hidden(values, "float16")
        assert lossy.channels.asked == [4 * HIDDEN]
        assert torch.equal(kept.tensor(), values), "its tensor, made once, is what a replay reads"

        # a tensor's step asks the same question once too
        request, _ = stream._request(values, None, [], None)
        assert request == compact.step_frame(KEY, SID, 2, 1, 1, HIDDEN, values.numpy().tobytes())
        assert stream.channels.asked == [4 * HIDDEN] * 2
    finally:
        pair[0].close()
        pair[1].close()


def test_a_relayed_decode_step_asks_each_hops_wire_format_once_and_keeps_its_tokens(tiny_bloom, monkeypatch):
    """3 servers relayed on frames: per decode step one question of the wire format per hop (round 18 asked a
    relayed hop's twice), none once the relay lane takes the steps (a fixed format: client/relay.py RelayLane), every
    step from the caller's thread, and the greedy tokens transformers' own."""
    asked = []
    wire_dtype_for = Channels.wire_dtype_for
    monkeypatch.setattr(Channels, "wire_dtype_for",
                        lambda self, address, n=None: asked.append(address) or wire_dtype_for(self, address, n))
    ids, want = greedy_reference(tiny_bloom, "the client's hop", 5)
    with in_process_swarm(tiny_bloom, [BlockRange(0, 2), BlockRange(2, 4), BlockRange(4, 6)]) as swarm:
        client = client_of(swarm, frames=True, push=False)
        try:
            with torch.no_grad(), client.inference_session(max_length=ids.shape[1] + 8) as session:
                logits = client.step_logits(session, ids)
                tokens = [int(logits[0, -1].argmax())]
                route = [s.span.address for s in session.spans]
                for k in range(4):
                    asked.clear()
                    logits = client.step_logits(session, torch.tensor([[tokens[-1]]]))
                    tokens.append(int(logits[0, -1].argmax()))
                    assert asked == (route if k == 0 else [])
                assert all(step.blocking and len(step.hops) == 3 for step in session.steps[1:])
                history = session.spans[2].history  # (the last hop's inputs: relayed replies, as tensors)
                assert all(isinstance(h, torch.Tensor) for h, _ in history) and len(history) == 5
        finally:
            client.close()
    assert tokens == want
    assert np.isfinite(logits.numpy()).all()
