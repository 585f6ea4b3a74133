"""A hung server (alive, its stream open, never answering) is named, banned and failed over like a crash: SIGSTOP the
second server of the route mid-generation, with a replica of its blocks up; the tokens equal plain transformers'."""
from __future__ import annotations

import os
import signal
import time

import pytest

from swarmlm.types import BlockRange
from tests.swarm_helpers import greedy_reference, running_swarm

pytestmark = pytest.mark.slow
NEW_TOKENS = 16
STOP_AT = 6  # the token at which the route's second server stops answering


@pytest.fixture(scope="module")
def swarm(tiny_bloom):
    # blocks [3, 6) twice: the stopped server has a replica; [0, 3) once, so the first hop is never the culprit
    with running_swarm(tiny_bloom, [BlockRange(0, 3), BlockRange(3, 6), BlockRange(3, 6)], ban_base_s=60.0,
                       ban_max_s=60.0) as (swarm, client):
        deadline = time.monotonic() + 60
        while len(client.remote.view.records) < 3:  # the failover needs the replica in the client's view
            assert time.monotonic() < deadline, "the replica never appeared in the DHT"
            time.sleep(0.5)
            client.remote.refresh()
        yield swarm, client


def test_sigstop_mid_generation_names_and_bans_the_stopped_server(swarm, tiny_bloom):
    swarm_, client = swarm
    ids, want = greedy_reference(tiny_bloom, "the quick brown fox", NEW_TOKENS)

    stopped = None
    tokens = []
    try:
        with client.inference_session(max_length=ids.shape[1] + NEW_TOKENS) as session:
            logits = client.step_logits(session, ids)
            for n in range(NEW_TOKENS):
                if n == STOP_AT:
                    victim_id = session.spans[1].span.server_id
                    stopped = next(s for s in swarm_.servers if s.server_id == victim_id)
                    os.kill(stopped.proc.pid, signal.SIGSTOP)  # alive, its connections open, silent
                nxt = logits[:, -1].argmax(-1, keepdim=True)
                tokens.append(int(nxt))
                if n + 1 < NEW_TOKENS:
                    logits = client.step_logits(session, nxt)
            steps = list(session.steps)
            final_route = [s.server_id for s in session.route_spans()]
    finally:
        if stopped is not None:
            os.kill(stopped.proc.pid, signal.SIGCONT)
    assert stopped is not None
    assert tokens == want
    hung = [sid for s in steps for sid in s.hung]
    assert hung == [stopped.server_id]  # named: the stopped server, not the first hop
    assert sum(s.failovers for s in steps) == 1 and sum(s.stalls for s in steps) == 0
    assert stopped.server_id in client.remote.view.banned()
    assert stopped.server_id not in final_route


def test_the_hang_timeout_follows_the_announced_speed():
    """Floor + factor x announced compute for the step over the span, capped by step_timeout_s."""
    from swarmlm.client.pipeline import hang_timeout_s, watchdog_s
    from swarmlm.config import ClientConfig
    from swarmlm.perf.model import ComputeProfile
    from swarmlm.types import Span

    cfg = ClientConfig(hang_factor=10.0, hang_floor_s=5.0, step_timeout_s=60.0)
    rec = ComputeProfile(prefill_a_s=0.001, prefill_b_s=0.02, decode_s=0.01)
    span = Span("s", 0, 4)
    # a decode step, a prompt from scratch, a speculative pass of 4 tokens past the cache (extend_s, as pass_s)
    assert hang_timeout_s(cfg, rec, span, rows=1, n_tokens=1, cached=True) == pytest.approx(5.0 + 10 * 0.01 * 4)
    assert hang_timeout_s(cfg, rec, span, rows=2, n_tokens=100, cached=False) == pytest.approx(
        5.0 + 10 * (0.001 * 200 + 0.02) * 4)
    assert hang_timeout_s(cfg, rec, span, rows=1, n_tokens=4, cached=True) == pytest.approx(
        5.0 + 10 * (0.01 + 0.001 * 3) * 4)
    assert hang_timeout_s(cfg, rec, span, rows=64, n_tokens=2048, cached=False) == 60.0  # capped
    assert hang_timeout_s(cfg, None, span, rows=1, n_tokens=1, cached=True) == 5.0  # nothing announced: the floor
    assert watchdog_s(cfg) > 60.0  # behind every reply's own bound
