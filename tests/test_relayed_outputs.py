"""A relayed hop's reply on the client's blocking path (client/streams.py `Undecoded`): checked as a decoded one is,
its bytes sent on as they came, and a tensor only where one is read (the history of a failover or a cache op)."""
from __future__ import annotations

import pytest
import torch

from swarmlm.client.pipeline import OpenSpan
from swarmlm.client.streams import Undecoded
from swarmlm.errors import InvalidRequest
from swarmlm.types import CacheOp, Span
from swarmlm.wire import codec
from swarmlm.wire import swarm_pb2 as pb


def _undecoded(values: torch.Tensor) -> Undecoded:
    message = codec.encode(values)
    return Undecoded(message.data, codec.checked(message, "reply hidden"))


def test_an_undecoded_reply_is_checked_like_a_decoded_one():
    good = codec.encode(torch.randn(1, 1, 8))
    assert codec.checked(good) == (1, 1, 8)
    short = pb.Tensor(data=good.data[:-4], dtype="float32", shape=[1, 1, 8])
    for bad in (short, pb.Tensor(data=good.data, dtype="float64", shape=[1, 1, 8]),
                pb.Tensor(data=good.data, dtype="float32", shape=[1, 1, 1, 1, 8])):
        with pytest.raises(InvalidRequest):
            codec.checked(bad, "reply hidden")
        with pytest.raises(InvalidRequest):
            codec.decode(bad, "reply hidden")


def test_an_undecoded_reply_goes_on_as_its_bytes_and_decodes_to_its_values():
    values = torch.randn(2, 1, 8)
    kept = _undecoded(values)
    sent = kept.as_sent()
    assert sent == codec.encode(values)
    assert bytes(kept.data) == values.numpy().tobytes()  # (what a compact STEP carries on: wire/compact.py)
    assert torch.equal(kept.tensor(), values) and kept.tensor() is kept.tensor()


def test_a_history_of_undecoded_inputs_reads_as_tensors_and_follows_cache_ops():
    span = OpenSpan(Span("s", 0, 2, "127.0.0.1:1"), stream=None)
    steps = [torch.randn(2, 3, 8), torch.randn(2, 1, 8), torch.randn(2, 1, 8)]
    mask = [torch.ones(2, s.shape[1], dtype=torch.long) for s in steps]
    span.answered(steps[0], mask[0])
    for hidden, m in zip(steps[1:], mask[1:]):
        span.answered(_undecoded(hidden), m)
    assert span.cached and span.position == 5 and span.rows == 2
    assert any(isinstance(h, Undecoded) for h, _ in span._history)  # (nothing decoded by the steps)
    history = span.history
    assert all(isinstance(h, torch.Tensor) for h, _ in history)
    assert torch.equal(torch.cat([h for h, _ in history], dim=1), torch.cat(steps, dim=1))
    span.answered(_undecoded(torch.randn(2, 1, 8)), torch.ones(2, 1, dtype=torch.long))
    span.edit(CacheOp(truncate_to=4, rows=(1,)))
    assert span.position == 4 and span.rows == 1
    assert torch.equal(torch.cat([h for h, _ in span.history], dim=1), torch.cat(steps, dim=1)[1:, :4])
