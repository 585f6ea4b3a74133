"""The event loop and the slot accounting, on hand-computed scenarios."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from swarmlm.perf.model import ComputeProfile, Network, PerfModel
from swarmlm.sim.arrivals import SimRequest
from swarmlm.sim.cluster import Cluster, SimServerConfig, SimServer, slots_from_memory
from swarmlm.sim.engine import EventLoop
from swarmlm.sim.routers import FixedRouter
from swarmlm.sim.session import ClientBehaviour
from swarmlm.sim.simulator import run_simulation
from swarmlm.types import Route, Span


# -- the engine ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ping:
    time_s: float
    name: str
    then: tuple = ()  # (delay, name) of the events this one causes

    def handle(self, log: list) -> list:
        log.append((self.time_s, self.name))
        return [Ping(self.time_s + d, n) for d, n in self.then]


def test_engine_runs_events_in_time_then_fifo_order():
    log: list = []
    eng = EventLoop(log)
    eng.schedule(Ping(2.0, "late"))
    eng.schedule(Ping(1.0, "a", then=((0.0, "a-now"), (0.5, "a-later"))))
    eng.schedule(Ping(1.0, "b"))
    stats = eng.run()
    # same-time events keep their scheduling order; caused events join the queue behind existing ones
    assert log == [(1.0, "a"), (1.0, "b"), (1.0, "a-now"), (1.5, "a-later"), (2.0, "late")]
    assert stats.events == 5 and stats.end_time_s == 2.0 and not stats.stopped_early


def test_engine_refuses_events_in_the_past_and_stops_at_until():
    log: list = []
    eng = EventLoop(log)
    eng.schedule(Ping(1.0, "a", then=((-0.5, "past"),)))
    with pytest.raises(ValueError, match="not in"):
        eng.run()
    eng2 = EventLoop([])
    for t in (1.0, 2.0, 3.0):
        eng2.schedule(Ping(t, str(t)))
    stats = eng2.run(until_s=2.5)
    assert stats.stopped_early and stats.events == 2 and eng2.pending == 1
    with pytest.raises(ValueError):
        eng2.schedule(Ping(math.nan, "nan"))


# -- slot accounting --------------------------------------------------------------------------------------
def test_slots_from_memory_and_refusal_is_not_an_exception():
    assert slots_from_memory(10e9, 1e9, 0.5e9, 4) == 12  # (10 - 4) / 0.5
    assert slots_from_memory(3e9, 1e9, 1e9, 4) == 0
    server = SimServer(SimServerConfig("s", 0, 2, slots=3))
    assert server.try_allocate(2, 0.0) and not server.try_allocate(2, 1.0)  # refusal: False, state unchanged
    assert server.used == 2 and server.free == 1
    server.release(2, 2.0)
    rec = server.record(4.0)
    assert rec.slot_s == pytest.approx(4.0) and rec.busy_s == pytest.approx(2.0) and rec.peak_slots == 2


def test_cluster_allocation_is_all_or_nothing():
    cluster = Cluster([SimServerConfig("a", 0, 2, 2), SimServerConfig("b", 2, 4, 1)])
    assert cluster.allocate([("a", 2), ("b", 2)], 0.0) == "b"
    assert cluster.servers["a"].used == 0  # nothing held after a refusal
    assert cluster.allocate([("a", 2), ("b", 1)], 0.0) is None
    assert (cluster.servers["a"].used, cluster.servers["b"].used) == (2, 1)


# -- the hand-computed 2-server, 3-request scenario -----------------------------------------------------
# client c; server A runs blocks [0, 2) with 2 slots (one session), B runs [2, 4) with 4 slots (two sessions).
# l_in = 10, l_out = 3, hidden state 1000 bytes/token; link c-B is 8 Mbit/s (1 ms per token each way); each hop's
# messages cost o = 0.002 beyond the RTT (PerfModel.message_overhead_s).
#   prefill hop A = RTT 0.010 + o 0.002 + 2 blocks * (0.001 * 10 + 0.010)       = 0.052
#   prefill hop B = RTT 0.020 + o 0.002 + 2 * 10 ms transfer + 2 blocks * 0.020 = 0.082   -> TTFT 0.134
#   decode hop  A = 0.010 + 0.002 + 2 * 0.005                                   = 0.022
#   decode hop  B = 0.020 + 0.002 + 2 * 1 ms + 2 * 0.002                        = 0.028   -> step 0.050
#   one request = 0.134 + 2 * 0.050 = 0.234
def _two_server_setup():
    net = Network()
    net.set_link("c", "A", 0.010)
    net.set_link("c", "B", 0.020, bandwidth_bps=8e6)
    perf = PerfModel({"A": ComputeProfile(0.001, 0.010, 0.005), "B": ComputeProfile(0.0, 0.020, 0.002)}, net,
                     hidden_bytes_per_token=1000, message_overhead_s=0.002)
    servers = [SimServerConfig("A", 0, 2, slots=2), SimServerConfig("B", 2, 4, slots=4)]
    route = Route((Span("A", 0, 2), Span("B", 2, 4)))
    requests = [SimRequest(i, "c", t, 10, 3) for i, t in enumerate((0.0, 0.05, 0.1))]
    return servers, perf, FixedRouter(route), requests


def _times(result):
    return [(r.wait_s, r.ttft_s, r.finish_s) for r in result.records]


@pytest.mark.parametrize("token_events", [True, False])
def test_hand_computed_scenario_queue_mode(token_events):
    servers, perf, router, requests = _two_server_setup()
    res = run_simulation(servers, perf, router, requests, ClientBehaviour(wait_mode="queue"), token_events)
    # r0 runs at once; r1 and r2 queue at A; r1 starts when r0 ends (0.234), r2 when r1 ends (0.468)
    # (wait, TTFT from arrival, finish): r1 (0.234 - 0.05, 0.184 + 0.134, 0.468), r2 (0.468 - 0.1, ..., 0.702)
    expected = [(0.0, 0.134, 0.234), (0.184, 0.318, 0.468), (0.368, 0.502, 0.702)]
    for got, want in zip(_times(res), expected):
        assert got == pytest.approx(want, abs=1e-12)
    r = res.records[1]
    assert r.decode_per_token_s == pytest.approx(0.050, abs=1e-12)
    assert r.per_token_s == pytest.approx((0.468 - 0.05) / 3, abs=1e-12)
    # r1 and r2 each tried once on arrival and once when woken: at 0.234 only r1 fits, so only r1 is woken
    assert [x.attempts for x in res.records] == [1, 2, 2]
    a, b = res.servers
    assert (a.peak_slots, b.peak_slots) == (2, 2)  # never above the slots; B never had two sessions at once
    assert a.slot_s == pytest.approx(2 * 0.702, abs=1e-12)  # A was full the whole run
    assert a.compute_s == pytest.approx(3 * 2 * (0.020 + 2 * 0.005), abs=1e-12)
    assert res.summary["requests"] == 3 and res.summary["completed"] == 3


def test_hand_computed_scenario_backoff_mode():
    servers, perf, router, requests = _two_server_setup()
    res = run_simulation(servers, perf, router, requests, ClientBehaviour("backoff", retry_initial_s=0.1))
    # r1: refused at 0.05, 0.15 (+0.1, +0.2) -> admitted 0.35 (r0 left at 0.234), ends 0.35 + 0.234 = 0.584.
    # r2: refused 0.1, 0.2, 0.4 (+0.1, +0.2, +0.4) -> admitted 0.8 (r1 still holds A at 0.4), ends 1.034
    expected = [(0.0, 0.134, 0.234), (0.30, 0.434, 0.584), (0.70, 0.834, 1.034)]
    for got, want in zip(_times(res), expected):
        assert got == pytest.approx(want, abs=1e-12)
    assert [x.attempts for x in res.records] == [1, 3, 4]


def test_client_times_out_like_the_real_client():
    servers, perf, router, requests = _two_server_setup()
    res = run_simulation(servers, perf, router, requests, ClientBehaviour(wait_mode="queue", timeout_s=0.2))
    statuses = [r.status for r in res.records]
    assert statuses == ["done", "done", "timeout"]  # r2 would start at 0.468 > its deadline 0.1 + 0.2
    assert res.records[2].finish_s == pytest.approx(0.3) and math.isnan(res.records[2].ttft_s)
    assert res.summary["timed_out"] == 1 and res.summary["completed"] == 2


# -- queue mode: who is woken, and when ------------------------------------------------------------------
class _PerRequestRouter:
    def __init__(self, routes: dict[int, Route]) -> None:
        self.routes = routes

    def choose(self, req, now_s):
        return self.routes[req.request_id]

    def admitted(self, req, route, now_s, until_s):
        pass

    def released(self, req, now_s):
        pass


def test_queue_passes_freed_slots_on_when_the_woken_waiter_is_blocked_elsewhere():
    net = Network(default_rtt_s=0.01)
    perf = PerfModel({s: ComputeProfile(0.0, 0.01, 0.005) for s in "ADBC"}, net)
    servers = [SimServerConfig(s, a, a + 2, slots=2) for s, a in (("A", 0), ("D", 0), ("B", 2), ("C", 2))]

    def route(first: str, second: str) -> Route:
        return Route((Span(first, 0, 2), Span(second, 2, 4)))
    routes = {0: route("A", "C"), 1: route("D", "B"), 2: route("A", "B"), 3: route("A", "C")}
    requests = [SimRequest(0, "c", 0.0, 4, 3), SimRequest(1, "c", 0.0, 4, 30),  # 1 holds B for long
                SimRequest(2, "c", 0.01, 4, 3), SimRequest(3, "c", 0.02, 4, 3)]  # both queue at A, 2 first
    res = run_simulation(servers, perf, _PerRequestRouter(routes), requests, ClientBehaviour("queue", timeout_s=60))
    r0, r1, r2, r3 = res.records
    # when 0 leaves A, 2 is woken first but B is still held by 1: 2 re-queues at B and A's slots go to 3 at once
    assert r3.start_s == r0.finish_s and r3.attempts == 2
    assert r2.start_s == r1.finish_s and r2.attempts == 3


def test_a_queue_head_that_times_out_lets_the_next_one_through():
    servers, perf, router, _ = _two_server_setup()
    requests = [SimRequest(0, "c", 0.0, 10, 3), SimRequest(1, "c", 0.01, 10, 3), SimRequest(2, "c", 0.15, 10, 3)]
    res = run_simulation(servers, perf, router, requests, ClientBehaviour("queue", timeout_s=0.2))
    r0, r1, r2 = res.records
    assert r1.status == "timeout" and r1.finish_s == pytest.approx(0.21)  # deadline before r0 ends at 0.234
    assert r2.status == "done" and r2.start_s == pytest.approx(0.234, abs=1e-12) and r2.attempts == 2
