"""An opened session waits for its first step as long as the route's earlier servers need (issue 35): a span from
block s is stepped only once blocks 0..s-1 ran the prompt, so its open-idle limit grows with those blocks' prefill
(priced by the server's measured profile), bounded by what one step buys a peer anyway (session_idle_timeout_s)."""
from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch

from swarmlm.config import UPSTREAM_PREFILL_SLACK, ServerConfig
from swarmlm.perf.compute import ComputeProfile
from swarmlm.types import BlockRange
from swarmlm.wire import codec
from swarmlm.wire import swarm_pb2 as pb
from tests.swarm_helpers import RawStream, in_process_server, poll_until

H = 64  # tiny-bloom hidden size


def test_the_limit_grows_with_the_blocks_before_the_span_and_stays_bounded():
    cfg = ServerConfig(model_dir="unused", blocks=None)
    assert cfg.open_idle_limit_s(0.0) == cfg.open_idle_timeout_s  # block 0: nobody computes before it
    # llama-8b at Q4_0 as measured here (a busy 2-core Xeon): a span from block 24, 2 rows of up to 20 tokens
    upstream = ComputeProfile(prefill_a_s=8.2e-4, prefill_b_s=0.317, decode_s=0.0195).step_s(24, 2, 20, cached=False)
    limit = cfg.open_idle_limit_s(upstream)
    assert limit == cfg.open_idle_timeout_s + UPSTREAM_PREFILL_SLACK * upstream > 2 * cfg.open_idle_timeout_s
    # a hostile open naming the last block and the longest session holds a slot no longer than one step would
    assert cfg.open_idle_limit_s(1e9) == cfg.session_idle_timeout_s


def _step(rows: int = 1, tokens: int = 4) -> pb.InferenceRequest:
    return pb.InferenceRequest(step=pb.InferenceStep(hidden=codec.encode(torch.randn(rows, tokens, H))))


def test_a_later_span_outlives_the_base_timeout_while_a_first_span_expires(tiny_bloom):
    with in_process_server(tiny_bloom, BlockRange(0, 2), open_idle_timeout_s=1.0) as server:
        service = server.service
        # hand-made measurements: a block takes 50 s to prefill (a big model on a busy machine)
        service.stats = dataclasses.replace(service.stats, prefill_a_s=0.0, prefill_b_s=50.0)
        first, _ = RawStream.open(server.address, 0, 2)  # block 0: stepped at once by its client, or never
        later, opened = RawStream.open(server.address, 1, 2)  # waits for block 0's prefill on another server
        try:
            assert poll_until(lambda: len(service.sessions.sessions) == 1)  # the first span's 1 s passed
            assert opened.session_id in service.sessions.sessions
            with pytest.raises(grpc.RpcError) as err:
                first.send(_step())
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            reply = later.send(_step())  # past the base 1 s (the old rule had closed it), within 1 + 2 x 50 s
            assert not reply.HasField("error") and reply.position == 4
        finally:
            first.drop()
            later.end()
