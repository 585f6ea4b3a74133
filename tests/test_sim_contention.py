"""The simulator with compute contention: servers step slower with the sessions they run (the performance model's
f(b)), WS-RR prices it, and the live client's router makes the same choices as the simulator's for the same load."""
from __future__ import annotations

import pytest

from swarmlm.client.router import CLIENT, LiveRouter, SwarmView
from swarmlm.config import MESSAGE_OVERHEAD_S as O  # a hop's messages, beyond RTT and compute
from swarmlm.config import ClientConfig
from swarmlm.perf.model import ComputeProfile, Network, PerfModel
from swarmlm.sim.arrivals import SimRequest
from swarmlm.sim.cluster import SimServerConfig
from swarmlm.sim.routers import FixedRouter, PlannerRouter
from swarmlm.sim.session import ClientBehaviour
from swarmlm.sim.simulator import run_simulation
from swarmlm.swarm.records import ServerRecord
from swarmlm.types import BlockRange, Route, Span

L = 4  # blocks
TAU, T4, T16 = 0.010, 0.025, 0.040  # f(4) = 2.5, f(16) = 4
CONTENDED = ComputeProfile(0.0, 0.020, TAU, T4, T16)
PAPER = ComputeProfile(0.0, 0.020, TAU)  # no contention measured: f = 1


def _perf(profile: ComputeProfile) -> PerfModel:
    net = Network()
    net.set_link("c", "A", 0.002)  # A is a little closer: shortest latency always picks it
    net.set_link("c", "B", 0.003)
    net.set_link("bg", "A", 0.002)
    net.set_link("bg", "B", 1000.0)  # the background client can only reach A
    return PerfModel({"A": profile, "B": profile}, net)


def _requests(n_new: int, n_background: int = 4) -> list[SimRequest]:
    # long background sessions on A from t = 0, then new clients 1 s apart, all still running when the last arrives
    reqs = [SimRequest(100 + i, "bg", 0.0, 8, 2000) for i in range(n_background)]
    return reqs + [SimRequest(i, "c", 1.0 + i, 8, 400) for i in range(n_new)]


def _simulate(profile: ComputeProfile, mode: str, n_new: int = 8):
    perf = _perf(profile)
    servers = [SimServerConfig("A", 0, L, slots=10_000), SimServerConfig("B", 0, L, slots=10_000)]
    router = PlannerRouter.build(perf, L, [("A", BlockRange(0, L), 10_000), ("B", BlockRange(0, L), 10_000)], mode)
    return run_simulation(servers, perf, router, _requests(n_new), ClientBehaviour(wait_mode="queue")), router


def _new_sessions_on(result) -> list[str]:
    return [r.route[0].server_id for r in sorted(result.records, key=lambda r: r.arrival_s) if r.client_id == "c"]


def test_ws_rr_splits_new_sessions_by_contention():
    res, router = _simulate(CONTENDED, "waiting-aware")
    assert not router.fast_path  # with contention the static route is no lower bound: every route is searched
    # the router pays f(b + 1): B until it runs as many as A (f(1..4) < f(5)), then by turns; RTT breaks the ties
    assert _new_sessions_on(res) == ["B", "B", "B", "B", "A", "B", "A", "B"]


def test_without_contention_ws_rr_and_shortest_agree():
    for mode in ("waiting-aware", "shortest"):
        res, _ = _simulate(PAPER, mode)
        assert _new_sessions_on(res) == ["A"] * 8, mode  # load costs nothing: all on the lower RTT
    res, _ = _simulate(CONTENDED, "shortest")
    assert _new_sessions_on(res) == ["A"] * 8  # shortest ignores load


def test_a_loaded_server_steps_slower():
    # k sessions admitted together on one server: while all run, every decode step costs RTT + o + L tau f(k) (o:
    # the messages' own cost, config.MESSAGE_OVERHEAD_S); the first admitted has the shortest prefill and ends
    # first, so all of its steps run at that load
    net = Network()
    net.set_link("c", "A", 0.002)
    perf = PerfModel({"A": CONTENDED}, net)
    route = Route((Span("A", 0, L),))
    for k, f in ((1, 1.0), (4, 2.5), (16, 4.0)):
        reqs = [SimRequest(i, "c", 0.0, 8, 20) for i in range(k)]
        for token_events in (True, False):  # coarse decode is ignored with contention: steps depend on load
            res = run_simulation([SimServerConfig("A", 0, L, slots=1000)], perf, FixedRouter(route), reqs,
                                 token_events=token_events)
            first = res.records[0]
            assert first.decode_per_token_s == pytest.approx(0.002 + O + L * TAU * f, abs=1e-12), k
            assert all(r.decode_per_token_s <= first.decode_per_token_s + 1e-12 for r in res.records)
    # uncontended profiles keep the paper's model: a step does not depend on the load
    perf = PerfModel({"A": PAPER}, net)
    res = run_simulation([SimServerConfig("A", 0, L, slots=1000)], perf, FixedRouter(route),
                         [SimRequest(i, "c", 0.0, 8, 20) for i in range(16)])
    assert {round(r.decode_per_token_s, 12) for r in res.records} == {round(0.002 + O + L * TAU, 12)}


def test_sessions_ending_speed_up_the_others():
    # two sessions on A: the short one ends, the long one's remaining steps run at f(1)
    net = Network()
    net.set_link("c", "A", 0.0)
    perf = PerfModel({"A": CONTENDED}, net)
    route = Route((Span("A", 0, L),))
    reqs = [SimRequest(0, "c", 0.0, 8, 101), SimRequest(1, "c", 0.0, 8, 11)]
    res = run_simulation([SimServerConfig("A", 0, L, slots=1000)], perf, FixedRouter(route), reqs)
    long, short = res.records
    f2 = CONTENDED.load_factor(2)
    assert short.decode_per_token_s == pytest.approx(O + L * TAU * f2, abs=1e-12)  # RTT 0 + o + compute
    assert O + L * TAU < long.decode_per_token_s < O + L * TAU * f2


def _live_router(sessions: dict[str, int], rtt: dict[str, float]) -> LiveRouter:
    view = SwarmView(ClientConfig(servers=("127.0.0.1:1",)))
    view.update({sid: ServerRecord(sid, f"127.0.0.{i + 1}:1", 0, L, decode_s=TAU, prefill_b_s=0.020,
                                   decode_4rows_s=T4, decode_16rows_s=T16, active_sessions=n)
                 for i, (sid, n) in enumerate(sessions.items())})
    view.rtt_s.update(rtt)
    return LiveRouter(view, L)


@pytest.mark.parametrize("load_a", range(0, 9))
@pytest.mark.parametrize("load_b", range(0, 9, 2))
def test_the_live_router_chooses_as_the_simulators(load_a, load_b):
    rtt = {"A": 0.002, "B": 0.003}
    live = _live_router({"A": load_a, "B": load_b}, rtt)
    chosen_live = live.route(0, L, 8, 400).spans[0].server_id
    # the simulator's router, with the same servers and RTTs, and the same load as sessions it admitted
    net = Network()
    for sid, r in rtt.items():
        net.set_link(CLIENT, sid, r)
    perf = PerfModel({"A": CONTENDED, "B": CONTENDED}, net)
    sim = PlannerRouter.build(perf, L, [("A", BlockRange(0, L), 10_000), ("B", BlockRange(0, L), 10_000)],
                              "waiting-aware")
    for sid, n in (("A", load_a), ("B", load_b)):
        for i in range(n):
            sim.admitted(SimRequest(1000 * (sid == "A") + i, CLIENT, 0.0, 8, 400), Route((Span(sid, 0, L),)),
                         0.0, 1e9)
    chosen_sim = sim.choose(SimRequest(5000, CLIENT, 0.0, 8, 400), 0.0).spans[0].server_id
    assert chosen_live == chosen_sim
    cheaper_a = CONTENDED.load_factor(load_a + 1) <= CONTENDED.load_factor(load_b + 1)
    assert chosen_sim == ("A" if cheaper_a else "B")
