"""Run requests through simulated servers: the state the session events share, and `run_simulation`.

Inputs are plain data (server block ranges and slots, a PerfModel, a router, requests); building them from a
topology file and the planner's placement is `swarmlm.sim.scenario`'s job.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from swarmlm.perf.model import PerfModel
from swarmlm.sim.arrivals import SimRequest
from swarmlm.sim.cluster import Cluster, SimServerConfig
from swarmlm.sim.engine import EventLoop
from swarmlm.sim.metrics import STATUS_DONE, RequestOutcome, ServerUsage, summarize
from swarmlm.sim.prefixes import PrefixStore
from swarmlm.sim.routers import SimRouter
from swarmlm.sim.session import (ENDED, QUEUED, RUNNING, WAITING, Arrive, ClientBehaviour, Retry, SimSession, Token,
                                 make_record)
from swarmlm.types import Route


class SimState:
    """Everything events read and write. Session events call these methods; nothing else mutates the cluster."""

    def __init__(self, cluster: Cluster, perf: PerfModel, router: SimRouter, behaviour: ClientBehaviour,
                 token_events: bool) -> None:
        self.cluster = cluster
        self.perf = perf
        self.router = router
        self.behaviour = behaviour
        self.token_events = token_events
        self.records: list[RequestOutcome] = []
        # some server's step time grows with the sessions it runs (PerfModel.load_factor): decode steps are then
        # timed one by one, each at the load of the moment, instead of once per session
        self.contended = any(perf.profiles[sid].contended for sid in cluster.servers)
        self.running = 0  # sessions holding slots now
        self.peak_running = 0
        self.prefixes = PrefixStore()  # shared prompt prefixes the servers keep; the router prices them too
        if hasattr(router, "prefixes"):
            router.prefixes = self.prefixes

    # -- called by session events ------------------------------------------------------------------------
    def admit(self, s: SimSession, route: Route, needs: list[tuple[str, int]], now_s: float) -> tuple[Token]:
        """Slots are held: compute the prefill and decode step times from the PerfModel and start prefill.

        Each hop runs at its server's load now (the sessions holding slots there, this one included); with
        contended servers the decode step is timed again at every token (`step_s`)."""
        req, perf, client = s.req, self.perf, s.req.client_id
        s.phase, s.route, s.needs, s.admitted_s = RUNNING, route, needs, now_s
        l_out = req.output_tokens
        l_in = req.input_tokens - self.prefixes.start(req, route)  # a cached prefix is not prefilled (nor sent)
        ttft = 0.0
        for span in route.spans:
            k = span.length
            ttft += perf.prefill_hop_s(client, span.server_id, k, l_in, self.cluster.servers[span.server_id].active)
            prof = perf.profiles[span.server_id]
            # one session's own compute (batch-1 rates): what utilisation counts
            self.cluster.servers[span.server_id].compute_s += k * (prof.prefill_s(l_in) + (l_out - 1) * prof.decode_s)
        step = s.step_s = self.step_s(s)
        first_s = now_s + ttft
        self.router.admitted(req, route, now_s, first_s + (l_out - 1) * step)
        self.running += 1
        self.peak_running = max(self.peak_running, self.running)
        return (Token(first_s, s, 1),)

    def step_s(self, s: SimSession) -> float:
        """One decode step of `s` through its route at every hop server's current load."""
        servers, client = self.cluster.servers, s.req.client_id
        return sum(self.perf.decode_hop_s(client, span.server_id, span.length, servers[span.server_id].active)
                   for span in s.route.spans)

    def finish(self, s: SimSession, now_s: float) -> list[Retry]:
        """Last token delivered: free the slots, tell the router, wake whoever queued on those servers."""
        self.cluster.release(s.needs, now_s)
        self.router.released(s.req, now_s)
        self.prefixes.finished(s.req, s.route)
        self.running -= 1
        s.phase = ENDED
        self.record(s, STATUS_DONE, now_s)
        wake: list[Retry] = []
        for sid, _ in s.needs:
            wake += self.pump(sid, now_s)
        return wake

    # -- queue mode: FIFO per server, woken only as far as the free slots go --------------------------------
    def enqueue(self, s: SimSession, server_id: str, need: int) -> None:
        s.phase, s.queued_at = QUEUED, server_id
        self.cluster.servers[server_id].waiters.append((s, need))

    def pump(self, server_id: str, now_s: float) -> list[Retry]:
        """Wake waiters at the head of the server's queue while their needs fit its unpromised free slots.

        Waking everyone on every release would be quadratic (thousands of waiters on a popular server); waking
        only what fits keeps it linear. Strict FIFO: a head that does not fit blocks the ones behind it.
        """
        server = self.cluster.servers[server_id]
        free = server.free - server.pending
        wake: list[Retry] = []
        while server.waiters and server.waiters[0][1] <= free:
            s, need = server.waiters.popleft()
            free -= need
            server.pending += need
            s.phase = WAITING
            wake.append(Retry(now_s, s, server_id, need))
        return wake

    def woken_done(self, server_id: str, need: int, now_s: float) -> list[Retry]:
        """A woken waiter has retried (admitted, re-queued elsewhere or gone): pass unused slots down the queue."""
        self.cluster.servers[server_id].pending -= need
        return self.pump(server_id, now_s)

    def unqueue(self, s: SimSession, now_s: float) -> list[Retry]:
        """A queued session gives up: leave the queue; if it was the head, the next ones may fit now."""
        waiters = self.cluster.servers[s.queued_at].waiters
        for i, (waiter, _) in enumerate(waiters):
            if waiter is s:
                del waiters[i]
                return self.pump(s.queued_at, now_s) if i == 0 else []
        raise AssertionError(f"request {s.req.request_id} is not in the queue of {s.queued_at}")

    def record(self, s: SimSession, status: str, end_s: float) -> None:
        self.records.append(make_record(s, status, end_s))


@dataclass(frozen=True)
class SimResult:
    records: tuple[RequestOutcome, ...]  # one per request, in request-id order
    servers: tuple[ServerUsage, ...]
    summary: dict  # metrics.summarize(...) plus engine statistics
    events: int  # events handled
    wall_s: float  # real seconds the run took


def run_simulation(
    servers: Sequence[SimServerConfig],
    perf: PerfModel,
    router: SimRouter,
    requests: Sequence[SimRequest],
    behaviour: ClientBehaviour = ClientBehaviour(),
    token_events: bool = True,
    on_progress: Callable[[int, int], None] | None = None,
) -> SimResult:
    """Simulate every request to completion (or timeout). `on_progress(finished, total)` is called now and then.

    token_events=False schedules one event for a whole decode instead of one per token; the results are
    identical (nothing can interrupt a step in this model), it only saves time on huge runs. With contended
    servers (profiles with a load factor) it is ignored: each step's time depends on the load of its moment.
    """
    wall0 = time.perf_counter()
    cluster = Cluster(list(servers))
    state = SimState(cluster, perf, router, behaviour, token_events)
    state.token_events = token_events or state.contended
    engine: EventLoop[SimState] = EventLoop(state)
    engine.schedule_all(Arrive(r.arrival_s, r) for r in requests)
    progress = None if on_progress is None else (lambda _events, _t: on_progress(len(state.records), len(requests)))
    stats = engine.run(on_progress=progress)
    if on_progress is not None:
        on_progress(len(state.records), len(requests))
    records = tuple(sorted(state.records, key=lambda r: r.request_id))
    _check_invariants(state, requests, records)
    end_s = max((r.finish_s for r in records), default=0.0)
    server_records = tuple(cluster.records(end_s))
    summary = summarize(records, server_records, end_s)
    summary.update(events=stats.events, peak_concurrent_sessions=state.peak_running,
                   prefix_hits=state.prefixes.hits, prefix_hit_tokens=state.prefixes.hit_tokens)
    return SimResult(records, server_records, summary, stats.events, time.perf_counter() - wall0)


def _check_invariants(state: SimState, requests: Sequence[SimRequest], records: tuple[RequestOutcome, ...]) -> None:
    """No request lost or duplicated; every slot returned; nobody left waiting."""
    ids = [r.request_id for r in records]
    expected = sorted(r.request_id for r in requests)
    if ids != expected:
        raise AssertionError(f"{len(expected)} requests in, {len(ids)} records out (lost or duplicated)")
    for server in state.cluster.servers.values():
        if server.used or server.active or server.waiters or server.pending:
            raise AssertionError(f"server {server.cfg.server_id} ends with {server.used} slots held, "
                                 f"{len(server.waiters)} waiters")
        if server.peak > server.cfg.slots:
            raise AssertionError(f"server {server.cfg.server_id} over-allocated: {server.peak} > {server.cfg.slots}")
    if state.running:
        raise AssertionError(f"{state.running} sessions still running at the end")
