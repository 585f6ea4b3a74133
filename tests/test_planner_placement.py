"""Placement: milp = exhaustive search, cg-bprr feasible / never better than milp / within Theorem 2."""
from __future__ import annotations

import random

import pytest

from tests.planner_fixtures import exhaustive_optimum, make_topology, random_topology
from swarmlm.errors import PlanningError
from swarmlm.perf.model import ComputeProfile, ModelSpec, ServerSpec
from swarmlm.planner.plan import PLACEMENTS
from swarmlm.planner.placement import (PlacementOptions, amortised_block_time_s, blocks_for_concurrency,
                                       choose_concurrency,
                                       choose_range, is_feasible, max_concurrency, petals_num_blocks,
                                       place_cg_bprr, request_clients, session_capacity)
from swarmlm.planner.hop_graph import bprr_hop_cost, shortest_route
from swarmlm.types import BlockRange


def _total_request_time(topology, ranges, concurrency):
    perf, wl, L = topology.perf, topology.workload, topology.model.num_blocks
    total = 0.0
    for client in request_clients(topology.clients, concurrency):
        spans = shortest_route(ranges, L, bprr_hop_cost(perf, client, wl.input_tokens, wl.output_tokens))
        total += perf.request_time_s(client, spans, wl.input_tokens, wl.output_tokens)
    return total


def _feasible(draw, R):
    """Draw instances until one satisfies the feasibility condition for R."""
    while True:
        topology = draw()
        if is_feasible(topology.servers, topology.model, R):
            return topology


@pytest.mark.parametrize("seed", range(5))
def test_milp_equals_exhaustive_search(seed):
    rng = random.Random(seed)
    topology = random_topology(rng, n_servers=3, n_clients=rng.choice([1, 2]), num_blocks=3, concurrency=2)
    exact = exhaustive_optimum(topology, 2)
    result = PLACEMENTS["milp"](topology, 2, PlacementOptions(time_limit_s=300))
    assert result.gap is not None and result.gap <= 1e-6
    assert result.objective_s == pytest.approx(exact, rel=1e-6)
    # the solver's own routes, evaluated by the PerfModel, cost what it claims
    perf, wl = topology.perf, topology.workload
    claimed = sum(perf.request_time_s(c, spans, wl.input_tokens, wl.output_tokens) for c, spans in result.routes)
    assert claimed == pytest.approx(exact, rel=1e-6)


@pytest.mark.parametrize("seed", range(30))
def test_cg_bprr_feasible_whenever_the_condition_holds(seed):
    rng = random.Random(100 + seed)
    L = rng.randint(2, 12)
    R = rng.randint(1, 6)
    topology = random_topology(rng, n_servers=rng.randint(1, 10), n_clients=2, num_blocks=L, concurrency=R,
                               memories=(1.2, 2.0, 3.5, 6.0, 10.0))
    if not is_feasible(topology.servers, topology.model, R):
        with pytest.raises(PlanningError):
            place_cg_bprr(topology, R)
        return
    result = place_cg_bprr(topology, R)
    capacity = [0] * L
    for name, rng_ in result.ranges.items():
        spec = topology.server(name)
        assert rng_.length == blocks_for_concurrency(spec.memory_bytes, topology.model, R)
        assert 0 <= rng_.start and rng_.end <= L
        for b in range(rng_.start, rng_.end):
            capacity[b] += session_capacity(spec.memory_bytes, topology.model, rng_.length)
    assert min(capacity) >= R


@pytest.mark.parametrize("seed", range(6))
def test_cg_bprr_never_better_than_milp(seed):
    rng = random.Random(200 + seed)
    topology = _feasible(lambda: random_topology(rng, n_servers=3, n_clients=2, num_blocks=4, concurrency=2,
                                                 memories=(2.2, 3.2, 5.0)), 2)
    cg = _total_request_time(topology, place_cg_bprr(topology, 2).ranges, 2)
    milp = PLACEMENTS["milp"](topology, 2, PlacementOptions(time_limit_s=300))
    assert milp.gap <= 1e-6
    assert cg >= milp.objective_s - 1e-9


@pytest.mark.parametrize("seed", range(40))
def test_cg_bprr_within_theorem2_bound(seed):
    # Theorem 2 bounds each request's per-token (decode) time; without prefill terms the shortest path
    # minimises exactly that time, so the routed decode step must be within the bound.
    rng = random.Random(300 + seed)
    R = rng.randint(1, 4)
    topology = _feasible(lambda: random_topology(rng, n_servers=rng.randint(2, 12), n_clients=3,
                                                 num_blocks=rng.randint(2, 10), concurrency=R,
                                                 memories=(1.6, 2.5, 4.0, 8.0), prefill=False), R)
    result = place_cg_bprr(topology, R)
    perf, wl, L = topology.perf, topology.workload, topology.model.num_blocks
    for c in topology.clients:
        spans = shortest_route(result.ranges, L, bprr_hop_cost(perf, c.name, wl.input_tokens, wl.output_tokens))
        assert perf.decode_step_s(c.name, spans) <= result.bound_s + 1e-12


def _suboptimality_instance(L: int):
    """The paper's example: L^2 servers that each fit L+1 blocks' worth of memory, R = L^2. With room for R
    sessions on every block CG can put only one block on each server; the optimum puts the whole model on
    every server and serves each request in one hop."""
    n = L * L
    rtt, tau = 0.1, 0.001
    servers = [(f"s{j}", float(L + 1), 0.0, tau) for j in range(n)]
    return make_topology(servers, {("c", f"s{j}"): rtt for j in range(n)}, ["c"], num_blocks=L,
                         block_bytes=1.0, cache_bytes=1.0 / L, concurrency=n,
                         message_overhead_s=0.0), rtt, tau  # the paper's example: its RTTs end to end


@pytest.mark.parametrize("L", [2, 3, 4])
def test_paper_suboptimality_example(L):
    topology, rtt, tau = _suboptimality_instance(L)
    R = L * L
    cg = place_cg_bprr(topology, R)
    assert all(r.length == 1 for r in cg.ranges.values())
    cg_total = _total_request_time(topology, cg.ranges, R)
    n = topology.workload.output_tokens - 1  # decode steps after the prompt (prefill costs only the RTT here)
    assert cg_total == pytest.approx(R * (L * rtt + n * L * (rtt + tau)))  # L hops per request
    # one session of L blocks fits next to the weights: L + (1/L) * L = L + 1, so one hop is possible
    assert topology.model.block_bytes * L + topology.model.cache_bytes_per_session_block * L <= L + 1
    optimum = R * (rtt + n * (rtt + L * tau))
    full = {s.name: BlockRange(0, L) for s in topology.servers}
    assert _total_request_time(topology, full, R) == pytest.approx(optimum)
    assert cg_total / optimum > 0.9 * L * (rtt + tau) / (rtt + L * tau)  # ratio grows like L: unbounded


def test_suboptimality_example_milp_finds_the_optimum():
    topology, rtt, tau = _suboptimality_instance(2)
    result = PLACEMENTS["milp"](topology, 4, PlacementOptions(time_limit_s=300))
    n = topology.workload.output_tokens - 1
    assert result.objective_s == pytest.approx(4 * (rtt + n * (rtt + 2 * tau)), rel=1e-6)
    assert all(r == BlockRange(0, 2) for r in result.ranges.values())


def test_petals_is_seeded_and_uses_its_memory_rule():
    rng = random.Random(7)
    topology = random_topology(rng, n_servers=8, n_clients=1, num_blocks=6, concurrency=1,
                               memories=(4.0, 6.0, 9.0))
    a = PLACEMENTS["petals"](topology, 1, PlacementOptions(seed=1, petals_reserve_bytes=0.0))
    b = PLACEMENTS["petals"](topology, 1, PlacementOptions(seed=1, petals_reserve_bytes=0.0))
    assert a.ranges == b.ranges
    for name, r in a.ranges.items():
        assert r.length == petals_num_blocks(topology.server(name).memory_bytes, topology.model,
                                             PlacementOptions(petals_reserve_bytes=0.0))


def test_choose_concurrency_littles_law_plus_one_std():
    assert choose_concurrency(0.5, 8.0, 100) == 6  # lambda T = 4, + 2
    assert choose_concurrency(0.5, 8.0, 5) == 5  # capped by memory
    assert choose_concurrency(0.0, 8.0, 5) == 1


def test_max_concurrency_and_feasibility():
    model = ModelSpec(4, 1.0, 0.1)
    servers = [ServerSpec(f"s{i}", 3.0, ComputeProfile(0, 0, 0.01)) for i in range(2)]
    # (6 - 1 * (4 + 2)) / (0.1 * 6) = 0
    assert max_concurrency(servers, model) == 0
    servers = [ServerSpec(f"s{i}", 5.0, ComputeProfile(0, 0, 0.01)) for i in range(2)]
    assert max_concurrency(servers, model) == 6  # (10 - 6) / 0.6
    assert is_feasible(servers, model, 1)  # 2 * min(floor(5/1.1), 4) = 8 >= 4
    assert not is_feasible(servers, model, 20)  # floor(5/3) = 1 each


def test_choose_range_petals_fills_the_weakest_window():
    model = ModelSpec(8, 1.0, 0.01)
    fast = ComputeProfile(0, 0, 0.001)
    existing = {"a": (ServerSpec("a", 100.0, fast), BlockRange(0, 4))}
    joining = ServerSpec("new", 4.5, fast)
    r = choose_range(joining, existing, model, "petals", options=PlacementOptions(petals_reserve_bytes=0.0))
    assert r == BlockRange(4, 8)


def test_choose_range_cg_bprr_covers_uncovered_demand():
    model = ModelSpec(10, 1.0, 0.1)
    prof = ComputeProfile(0, 0, 0.01)
    existing = {"a": (ServerSpec("a", 4.0, prof), BlockRange(0, 2)),
                "b": (ServerSpec("b", 4.0, prof), BlockRange(5, 7))}
    joining = ServerSpec("new", 3.6, prof)  # R = 2: floor(3.6 / 1.2) = 3 blocks
    r = choose_range(joining, existing, model, "cg-bprr", concurrency=2)
    assert r.length == 3
    assert r == BlockRange(2, 5)  # the first window made only of uncovered blocks
    with pytest.raises(PlanningError):
        choose_range(ServerSpec("tiny", 1.0, prof), existing, model, "cg-bprr", concurrency=2)


@pytest.mark.parametrize("seed", range(20))
def test_choose_range_one_server_at_a_time_covers_the_model(seed):
    # the live swarm: servers join one by one (in greedy order) and each picks its own range
    rng = random.Random(500 + seed)
    R = rng.randint(1, 4)
    topology = _feasible(lambda: random_topology(rng, n_servers=rng.randint(2, 10), n_clients=2,
                                                 num_blocks=rng.randint(2, 10), concurrency=R,
                                                 memories=(1.6, 2.5, 4.0, 8.0)), R)
    perf, model = topology.perf, topology.model
    able = [s for s in topology.servers if blocks_for_concurrency(s.memory_bytes, model, R) > 0]
    for s in topology.servers:
        if s not in able:  # too small for R sessions on even one block: refused, like in place_cg_bprr
            with pytest.raises(PlanningError):
                choose_range(s, {}, model, "cg-bprr", concurrency=R)
    order = sorted(able, key=lambda s: amortised_block_time_s(
        perf, topology.clients, s.name, blocks_for_concurrency(s.memory_bytes, model, R)))
    existing = {}
    for server in order:
        existing[server.name] = (server, choose_range(server, existing, model, "cg-bprr", concurrency=R,
                                                      perf=perf, clients=topology.clients))
    capacity = [0] * model.num_blocks
    for spec, r in existing.values():
        for b in range(r.start, r.end):
            capacity[b] += session_capacity(spec.memory_bytes, model, r.length)
    assert min(capacity) >= R
