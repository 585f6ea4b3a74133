"""The live client routes with the planner's WaitingAwareRouter (WS-RR), fed from the servers' Info: it spreads
concurrent sessions by load (its own, and what servers announce), where shortest-latency routing does not."""
from __future__ import annotations

import time

import pytest

from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.client.router import UNKNOWN_SLOTS
from swarmlm.client.channels import info
from swarmlm.planner.routing import WaitingAwareRouter
from swarmlm.types import BlockRange
from tests.swarm_helpers import InProcessSwarm, even_out_view, in_process_swarm



@pytest.fixture(scope="module")
def replicas(tiny_bloom):
    # the router fed from Info: the servers' processes are not the point, they run in this one
    with in_process_swarm(tiny_bloom, [BlockRange(0, 6)] * 2) as swarm:
        yield swarm


def client_for(swarm: InProcessSwarm, addresses: list[str], **kwargs) -> DistributedModelForCausalLM:
    """A client whose view is even and still (`refresh_even`). Load is what these tests vary."""
    kwargs.setdefault("records_max_age_s", 600.0)  # no re-read between the sessions of a test: a still view
    client = DistributedModelForCausalLM.from_pretrained(swarm.model_dir, servers=addresses, **kwargs)
    refresh_even(client)
    return client


def refresh_even(client: DistributedModelForCausalLM) -> None:
    """Read the servers' Info, then even out RTTs and contention (swarm_helpers.even_out_view): load decides."""
    client.remote.refresh()
    even_out_view(client)


def first_server(session) -> str:
    return session.route_spans()[0].server_id


def test_the_router_is_the_planners_ws_rr_fed_from_info(replicas):
    client = client_for(replicas, replicas.addresses)
    try:
        client.remote.refresh()
        for r in client.remote.view.records.values():  # each measured and announced its contention
            assert r.decode_4rows_s > 0 and r.decode_16rows_s > 0
        assert isinstance(client.remote.router.router, WaitingAwareRouter)
        records = client.remote.view.records
        assert len(records) == 2
        for r in records.values():  # slots come from the announced cache and per-token session bytes
            assert r.session_bytes_per_block_token > 0 and r.cache_bytes_total > 0
        client.remote.route(0, 6, 16, 16, max_length=64)
        for sid in records:
            assert 0 < client.remote.router.router.free_slots(sid) < UNKNOWN_SLOTS
    finally:
        client.close()


def test_concurrent_sessions_spread_by_the_clients_own_load(replicas):
    client = client_for(replicas, replicas.addresses)
    sessions = []
    try:
        sessions = [client.inference_session(max_length=32).open() for _ in range(4)]
        used = [first_server(s) for s in sessions]
    finally:
        for s in sessions:
            s.close()
        client.close()
    assert sorted(used.count(sid) for sid in set(used)) == [2, 2], used


def test_announced_load_steers_a_new_client_and_shortest_ignores_it(replicas):
    probe = client_for(replicas, replicas.addresses)
    with probe.inference_session(max_length=32) as s:
        preferred = first_server(s)  # where an idle swarm sends a session
    probe.close()
    busy = next(p for p in replicas.servers if p.server_id == preferred)
    other = next(p for p in replicas.servers if p.server_id != preferred)
    pinned = client_for(replicas, [busy.address])  # another user's sessions, on the preferred server only
    held = [pinned.inference_session(max_length=32).open() for _ in range(2)]
    wa = client_for(replicas, replicas.addresses)
    shortest = client_for(replicas, replicas.addresses, routing="shortest")
    try:
        deadline = time.monotonic() + 60
        while True:  # wait until the server announces them (Info)
            reply, _ = wa.remote.loop.run(info(wa.remote.channels, busy.address))
            if reply.active_sessions >= 2:
                break
            assert time.monotonic() < deadline, "the held sessions never showed in the server's Info"
            time.sleep(0.2)
        refresh_even(wa)
        with wa.inference_session(max_length=32) as s:
            assert first_server(s) == other.server_id  # WS-RR: the idle replica
        refresh_even(shortest)
        both = [shortest.inference_session(max_length=32).open() for _ in range(2)]
        used = [first_server(s) for s in both]
        for s in both:
            s.close()
        assert used[0] == used[1], used  # shortest latency: neither its own nor the announced load counts
    finally:
        for s in held:
            s.close()
        for c in (pinned, wa, shortest):
            c.close()
