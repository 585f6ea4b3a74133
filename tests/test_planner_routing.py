"""Routing: shortest path over feasible hops equals brute force; WS-RR waits and detours."""
from __future__ import annotations

import math
import random

import pytest

from tests.planner_fixtures import _chains
from swarmlm.config import MESSAGE_OVERHEAD_S
from swarmlm.errors import MissingBlocks
from swarmlm.perf.model import ComputeProfile, Network, PerfModel
from swarmlm.planner.hop_graph import bprr_hop_cost, shortest_route
from swarmlm.planner.routing import WaitingAwareRouter
from swarmlm.types import BlockRange, Route, Span


def _random_ranges(rng: random.Random, n: int, L: int) -> dict[str, BlockRange]:
    out = {}
    for j in range(n):
        a = rng.randrange(L)
        out[f"s{j}"] = BlockRange(a, rng.randint(a + 1, L))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_shortest_route_matches_brute_force(seed):
    rng = random.Random(seed)
    L = rng.randint(1, 8)
    ranges = _random_ranges(rng, rng.randint(1, 7), L)
    weight = {s: rng.uniform(0.1, 1.0) for s in ranges}
    fixed = {s: rng.uniform(0.0, 2.0) for s in ranges}

    def cost(prev, server, start, end):
        return fixed[server] + weight[server] * (end - start)

    chains = _chains(ranges, L)
    if not chains:
        with pytest.raises(MissingBlocks):
            shortest_route(ranges, L, cost)
        return
    best = min(sum(cost(None, s.server_id, s.start, s.end) for s in ch) for ch in chains)
    for exact_prev in (False, True):
        spans = shortest_route(ranges, L, cost, exact_prev=exact_prev)
        Route(tuple(spans))  # contiguous, no overlap
        assert spans[0].start == 0 and spans[-1].end == L
        for s in spans:
            assert ranges[s.server_id].start <= s.start < s.end == ranges[s.server_id].end
        assert sum(cost(None, s.server_id, s.start, s.end) for s in spans) == pytest.approx(best)


def test_prev_dependent_cost_is_exact_with_exact_prev():
    # s0 -> s1 is expensive, s0 -> s2 cheap; only the server DP sees it
    ranges = {"s0": BlockRange(0, 2), "s1": BlockRange(2, 4), "s2": BlockRange(1, 4), "s3": BlockRange(0, 1)}
    pair = {("s0", "s1"): 10.0}

    def cost(prev, server, start, end):
        return 1.0 + pair.get((prev, server), 0.0) + (0.1 if server == "s2" else 0.0)

    spans = shortest_route(ranges, 4, cost, exact_prev=True)
    assert [s.server_id for s in spans] in (["s0", "s2"], ["s3", "s2"])


def test_missing_blocks_are_named():
    with pytest.raises(MissingBlocks) as info:
        shortest_route({"a": BlockRange(0, 2), "b": BlockRange(4, 6)}, 7, lambda *a: 1.0)
    assert info.value.missing == [2, 3, 6]
    assert "2-3, 6" in str(info.value)


def _perf(rtts: dict[str, float], decode: dict[str, float]) -> PerfModel:
    net = Network()
    for s, v in rtts.items():
        net.set_link("c", s, v)
    return PerfModel({s: ComputeProfile(0.0, 0.0, d) for s, d in decode.items()}, net)


def test_bprr_hop_cost_is_the_paper_edge_weight():
    net = Network()
    net.set_link("c", "s", 0.02)
    # the paper's setup: its RTTs were measured end to end, so no message cost on top (o = 0)
    perf = PerfModel({"s": ComputeProfile(0.0001, 0.03, 0.003)}, net, message_overhead_s=0.0)
    l_in, l_out, k = 20, 128, 3
    expect = (0.02 + (l_out - 1) * 0.02) + ((0.0001 * l_in + 0.03) + (l_out - 1) * 0.003) * k
    assert bprr_hop_cost(perf, "c", l_in, l_out)(None, "s", 0, k) == pytest.approx(expect)
    spans = [Span("s", 0, k)]
    assert perf.request_time_s("c", spans, l_in, l_out) == pytest.approx(expect)
    assert perf.per_token_s("c", spans, l_in, l_out) == pytest.approx(expect / l_out)
    # by default every one of the l_out round trips (the prompt's, then one per further token) adds o
    perf = PerfModel({"s": ComputeProfile(0.0001, 0.03, 0.003)}, net)
    with_o = expect + l_out * MESSAGE_OVERHEAD_S  # 0.7 ms each: + 0.0896 s over 128 tokens
    assert bprr_hop_cost(perf, "c", l_in, l_out)(None, "s", 0, k) == pytest.approx(with_o)
    assert perf.request_time_s("c", spans, l_in, l_out) == pytest.approx(with_o)


def test_hidden_state_transfer_adds_serialisation_time():
    net = Network()
    net.set_link("c", "s", 0.01, bandwidth_bps=8e6)  # 1 MB/s
    perf = PerfModel({"s": ComputeProfile(0, 0, 0)}, net, hidden_bytes_per_token=1000.0)
    assert perf.transfer_s("c", "s", 1000.0) == pytest.approx(0.005 + 0.001)
    # RTT + o + 10 tokens x 1000 bytes each way at 1 MB/s (no compute)
    assert perf.prefill_hop_s("c", "s", 1, 10) == pytest.approx(0.01 + MESSAGE_OVERHEAD_S + 2 * 0.01)


def test_waiting_aware_router_detours_around_a_full_server():
    # "fast" serves everything but has cache for one session; "slow" also serves everything.
    perf = _perf({"fast": 0.01, "slow": 0.01}, {"fast": 0.001, "slow": 0.004})
    router = WaitingAwareRouter(perf, 4)
    router.set_server("fast", BlockRange(0, 4), total_slots=4)
    router.set_server("slow", BlockRange(0, 4), total_slots=100)
    first = router.route("c", 0.0, 10, 100)
    assert [s.server_id for s in first.spans] == ["fast"] and first.start_times_s == [0.0]
    done = perf.request_time_s("c", first.spans, 10, 100)
    router.admit("r1", first.spans, done)
    assert router.free_slots("fast") == 0
    # shortest path ignores the wait and queues behind r1; WS-RR detours to "slow" if that is sooner
    queued = router.route("c", 0.0, 10, 100, waiting_aware=False)
    assert [s.server_id for s in queued.spans] == ["fast"] and queued.start_s == pytest.approx(done)
    detour = router.route("c", 0.0, 10, 100)
    assert [s.server_id for s in detour.spans] == ["slow"] and detour.start_s == 0.0
    # once r1 expires the fast server is free again
    assert router.expire(done) == ["r1"]
    assert [s.server_id for s in router.route("c", done, 10, 100).spans] == ["fast"]


def test_waiting_aware_router_waits_when_waiting_is_cheaper():
    perf = _perf({"fast": 0.01, "slow": 0.5}, {"fast": 0.001, "slow": 0.05})
    router = WaitingAwareRouter(perf, 2)
    router.set_server("fast", BlockRange(0, 2), total_slots=2)
    router.set_server("slow", BlockRange(0, 2), total_slots=2)
    router.admit("r1", [Span("fast", 0, 2)], until_s=1.0)
    choice = router.route("c", 0.5, 10, 100)
    assert [s.server_id for s in choice.spans] == ["fast"]
    assert choice.start_times_s == [1.0]
    spans, starts = choice  # unpacks as (spans, start_times)
    assert starts == [1.0]


def test_router_partial_hops_take_only_their_blocks_and_release_frees_slots():
    perf = _perf({"a": 0.01, "b": 0.01}, {"a": 0.001, "b": 0.001})
    router = WaitingAwareRouter(perf, 6)
    router.set_server("a", BlockRange(0, 4), total_slots=10)
    router.set_server("b", BlockRange(2, 6), total_slots=10)
    spans = [Span("a", 0, 4), Span("b", 4, 6)]
    router.admit("s", spans, until_s=5.0)
    assert router.free_slots("a") == 6 and router.free_slots("b") == 8
    router.set_load("b", 1)  # another client's sessions, announced by the server
    assert router.free_slots("b") == 1
    assert router.earliest_start_s("b", 2, 0.0) == pytest.approx(5.0)
    router.release("s")
    assert router.free_slots("a") == 10 and router.active_sessions == 0
    assert math.isinf(router.earliest_start_s("a", 11, 0.0))


@pytest.mark.parametrize("seed", range(30))
def test_affine_fast_path_matches_the_generic_search(seed):
    from swarmlm.planner.hop_graph import HopGraph
    rng = random.Random(1000 + seed)
    L = rng.randint(1, 8)
    ranges = _random_ranges(rng, rng.randint(1, 12), L)
    for j in range(rng.randint(0, 10)):  # many servers share a range, as on large swarms
        ranges[f"dup{j}"] = ranges[rng.choice(sorted(ranges))]
    fixed = {s: rng.choice([0.5, 1.0, rng.uniform(0, 2)]) for s in ranges}
    per_block = {s: rng.choice([0.1, 0.3, rng.uniform(0, 1)]) for s in ranges}
    free = {s: rng.randint(0, 8) for s in ranges}
    wait = {s: rng.uniform(0, 3) for s in ranges}
    try:
        graph = HopGraph(ranges, L)
    except MissingBlocks:
        return
    for use_free in (False, True):
        def cost(prev, server, start, end):
            extra = wait[server] if use_free and end - start > free[server] else 0.0
            return fixed[server] + per_block[server] * (end - start) + extra
        generic = graph.shortest(cost)
        fast = graph.shortest_affine(fixed, per_block, free if use_free else None,
                                     (lambda s, k: wait[s]) if use_free else None)
        total = lambda spans: sum(cost(None, s.server_id, s.start, s.end) for s in spans)  # noqa: E731
        assert total(fast) == pytest.approx(total(generic))
