"""The client's relay lane (client/relay.py `RelayLane`): after a decode step whose hops all went through the C chain,
the session's next decode steps go straight into that chain while nothing the usual path decides about them has
changed. Whatever changes (a mask, a cache op, the view's records, the router's links, another shape) gives that
step back to the usual path, which arms the lane again (a server's failure on a lane step: tests/test_relay_chain.py).
Every output is the one a client without the chain (its hops in Python) gets from the same servers."""
from __future__ import annotations

import pytest
import torch

from swarmlm.client.chunking import BandwidthEstimate
from swarmlm.client.relay import OutputBlock, RelayLane, chain_library
from swarmlm.client.session import LaneStepRecord
from swarmlm.client.streams import MAX_REPORTED_BATCH, HopTiming, SpanStream
from swarmlm.errors import InvalidRequest
from swarmlm.types import BlockRange, CacheOp
from swarmlm.wire import compact
from tests.swarm_helpers import client_of, greedy_reference, greedy_session, in_process_swarm

pytestmark = pytest.mark.skipif(chain_library() is None, reason="no C compiler: the chain is not built")

THREE = [BlockRange(0, 2), BlockRange(2, 4), BlockRange(4, 6)]


@pytest.fixture
def lane_steps(monkeypatch) -> list:
    """Every step a relay lane takes, as its session's position before it."""
    taken = []
    real = RelayLane.step

    def step(lane, x):
        taken.append(lane.session.position)
        return real(lane, x)

    monkeypatch.setattr(RelayLane, "step", step)
    return taken


def test_decode_steps_after_the_first_go_through_the_lane_with_transformers_tokens(tiny_bloom, lane_steps):
    ids, want = greedy_reference(tiny_bloom, "a lane for the steps", 7)
    with in_process_swarm(tiny_bloom, THREE) as swarm:
        client = client_of(swarm, frames=True, push=False)
        python = client_of(swarm, frames=True, push=False, relay_in_c=False)
        try:
            tokens, session = greedy_session(client, ids, 7)
            lane = list(lane_steps)
            python_tokens, python_session = greedy_session(python, ids, 7)
        finally:
            client.close()
            python.close()
    assert tokens == python_tokens == want
    # the prompt, then 6 decode steps: the first through the usual path (it arms the lane), 5 in the lane
    assert lane == [ids.shape[1] + k for k in range(1, 6)]
    history = [len(s.history) for s in session.spans]
    assert history == [len(s.history) for s in python_session.spans] == [1 + 6] * 3, "every input, for a replay"
    assert [len(s.hops) for s in session.steps] == [len(s.hops) for s in python_session.steps]
    for step in session.steps[1:]:  # each hop's timing recorded as the usual path records it
        assert step.blocking and not step.pushed and len(step.hops) == 3
        assert all(h.wall_s > 0 and h.compute_s > 0 and h.n_tokens == 1 for h in step.hops)


def test_whatever_changes_gives_the_step_back_to_the_usual_path(tiny_bloom, lane_steps):
    """One session's steps, with the lane's every reason to give way between them; the outputs are those of a
    client without the chain, step for step."""
    with in_process_swarm(tiny_bloom, THREE) as swarm:
        client = client_of(swarm, frames=True, push=False)
        python = client_of(swarm, frames=True, push=False, relay_in_c=False)
        hidden = client.config.hidden_size
        torch.manual_seed(0)
        xs = [torch.randn(1, 4, hidden)] + [torch.randn(1, 1, hidden) for _ in range(12)]
        ones = torch.ones(1, 1, dtype=torch.long)
        laned, outs, python_outs = [], [], []

        def events(c):
            """What happens before each decode step k (1..12), on client c."""
            return {
                3: lambda: c.remote.view.update(dict(c.remote.view.records)),  # the view's records read again
                5: lambda: c.inference_session(max_length=8).open().close(),  # another session routes: links synced
                7: "mask",  # the step's own padding mask (all ones): the usual path's to check
                9: "op",  # a cache op: the servers cut their caches first
            }

        try:
            for c, got in ((client, outs), (python, python_outs)):
                with torch.no_grad(), c.inference_session(max_length=32) as session:
                    got.append(session.step(xs[0]))
                    for k in range(1, len(xs)):
                        event = events(c).get(k)
                        before = len(lane_steps)
                        if event == "mask":
                            got.append(session.step(xs[k], mask=ones))
                        elif event == "op":
                            got.append(session.step(xs[k], op=CacheOp(truncate_to=session.position - 2)))
                        else:
                            if event is not None:
                                event()
                            got.append(session.step(xs[k]))
                        if c is client:
                            laned.append(len(lane_steps) > before)
        finally:
            client.close()
            python.close()
    # step 1 arms the lane; after each event the usual path takes the step and arms it again (a cache op's step
    # goes through Python's hops: the step after it arms the lane)
    assert laned == [False, True, False, True, False, True, False, True, False, False, True, True]
    for mine, theirs in zip(outs, python_outs):
        assert torch.allclose(mine, theirs, atol=1e-5)


def test_kept_outputs_and_history_stay_across_output_blocks_and_the_lane_stops_at_max_length(tiny_bloom, lane_steps,
                                                                                             monkeypatch):
    """The chain's outputs come from blocks made ahead (OutputBlock): with blocks of two steps, every output the
    caller kept and every span's history (a middle hop's input is the previous hop's output) is still what a client
    without the chain got, after many blocks; and the lane's room ends where the session's max_length does."""
    hidden_bytes = 4 * 64  # tiny-bloom's hidden size, float32, one row and token
    monkeypatch.setattr(OutputBlock, "BLOCK_BYTES", 2 * 3 * hidden_bytes)  # two steps of three hops
    with in_process_swarm(tiny_bloom, THREE) as swarm:
        client = client_of(swarm, frames=True, push=False)
        python = client_of(swarm, frames=True, push=False, relay_in_c=False)
        assert client.config.hidden_size * 4 == hidden_bytes
        torch.manual_seed(1)
        xs = [torch.randn(1, 3, 64)] + [torch.randn(1, 1, 64) for _ in range(9)]
        outs, histories = {}, {}
        try:
            for name, c in (("chain", client), ("python", python)):
                with torch.no_grad(), c.inference_session(max_length=12) as session:
                    outs[name] = [session.step(x) for x in xs]  # 3 + 9 tokens: the session is full
                    with pytest.raises(InvalidRequest, match="max_length 12 reached"):
                        session.step(xs[-1])
                    histories[name] = [span.history for span in session.spans]
        finally:
            client.close()
            python.close()
    assert len(lane_steps) == 8, "the first decode step arms the lane, the other 8 go through it"
    assert session._lane is None or not session._lane.takes(xs[-1])
    for mine, theirs in zip(outs["chain"], outs["python"], strict=True):
        assert torch.allclose(mine, theirs, atol=1e-5)
    for mine, theirs in zip(histories["chain"], histories["python"], strict=True):
        assert len(mine) == len(theirs) == 10
        for (h, m), (h2, m2) in zip(mine, theirs):
            assert torch.allclose(h, h2, atol=1e-5) and torch.equal(m, m2)


def test_a_lane_steps_hop_timings_made_when_read_are_those_of_its_step(tiny_bloom, lane_steps, monkeypatch):
    """A lane step's record makes its hops' timings only when they are read (LaneStepRecord): read after many more
    steps, they are what the chain's records said at each step (a hop's wall time from its write, or from its
    stream's previous reply if that came later), and each is the one its link's bandwidth estimate observed then."""
    at_the_time, observed = [], []
    relayed, observe = SpanStream.relayed, BandwidthEstimate.observe

    def relayed_now(stream, ints, times, nbytes, n_tokens, pushed_here=False):
        queued, compute, parse, encode, built, written, whole, checked = times
        started = max(written, stream._last_reply_s)
        at_the_time.append(HopTiming(stream.span.server_id, whole - started, queued, compute, parse + encode,
                                     (written - built) + (checked - whole), n_tokens, bool(ints[3] & compact.PUSHED),
                                     max(1, min(ints[2], MAX_REPORTED_BATCH))))
        return relayed(stream, ints, times, nbytes, n_tokens, pushed_here=pushed_here)

    def observed_now(estimate, bytes_total, network):
        observed.append((bytes_total, network))
        return observe(estimate, bytes_total, network)

    monkeypatch.setattr(SpanStream, "relayed", relayed_now)
    monkeypatch.setattr(BandwidthEstimate, "observe", observed_now)
    with in_process_swarm(tiny_bloom, THREE) as swarm:
        client = client_of(swarm, frames=True, push=False)
        try:
            with torch.no_grad(), client.inference_session(max_length=16) as session:
                session.step(torch.randn(1, 3, 64))
                observed.clear()  # (the prompt's, read in Python)
                for _ in range(8):
                    session.step(torch.randn(1, 1, 64))
                records = session.steps[1:]
        finally:
            client.close()
    assert len(lane_steps) == 7 and all(isinstance(r, LaneStepRecord) for r in records[1:])
    assert [r._unmade is not None for r in records[1:]] == [True] * 7, "nothing made before it was read"
    hops = [h for r in records for h in r.hops]
    assert hops == at_the_time and len(hops) == 8 * 3
    assert all(r.hops is r.hops for r in records), "made once"
    assert observed == [(2 * 4 * 64, h.network_s) for h in hops]
    assert all(r.n_tokens == 1 and r.blocking and not r.pushed and r.wall_s > 0 for r in records)
