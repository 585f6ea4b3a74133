"""Waiting-aware routing (WS-RR) on the hop graph of planner/hop_graph.py (client -> servers -> client).

`WaitingAwareRouter` adds each server's earliest free-slot time to the hop cost. The one router of
the live client (client/router.py feeds it announced records, measured RTTs and its own sessions) and of the
simulator (sim/routers.py: it admits/releases sessions as events fire). A hop's compute cost also grows with
the sessions running on its server, by the performance model's f(b) (`ComputeProfile.load_factor`, the
formula the simulated servers step with); profiles without a contention measurement keep f = 1 (the paper).
Static-cost routes (the planner, the paper's step 5) are `hop_graph.shortest_route`.

Public API (stable; the simulator and the client call it):

    RoutedHops(spans, start_times_s)                          # NamedTuple, unpacks as (spans, start_times)
    router = WaitingAwareRouter(perf, num_blocks)
    router.set_server(server_id, block_range, total_slots)    # (re)announce; slots are block-sessions
    router.set_load(server_id, free_slots, sessions=None)     # live: announced free slots and running sessions
    router.remove_server(server_id)
    router.route(client, now_s, l_in, l_out, waiting_aware=True, window=None, exclude=()) -> RoutedHops
    router.admit(session_id, spans, until_s)                  # reserve k slots per hop until until_s
    router.release(session_id)                                # free them (finished early / failed)
    router.expire(now_s) -> list[str]                         # drop sessions whose until_s <= now_s
    router.refresh()                                          # after changing perf profiles / RTTs
    router.free_slots(server_id), router.earliest_start_s(server_id, slots, now_s), router.active_sessions

Simulator recipe: on arrival `hops = router.route(c, now, l_in, l_out)`; start = hops.start_s;
done = start + perf.request_time_s(c, hops.spans, l_in, l_out); `router.admit(id, hops.spans, done)`;
on completion (or before each route) `router.expire(now)`. Slots are block-sessions: a server's total is
floor((M_j - s_m m_j) / s_c) (placement.cache_slots); a hop running k blocks holds k of them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple

from swarmlm.errors import MissingBlocks, PlanningError
from swarmlm.perf.model import PerfModel
from swarmlm.perf.prefix import prefix_saving_terms
from swarmlm.planner.hop_graph import HopGraph
from swarmlm.types import BlockRange, Span


class RoutedHops(NamedTuple):
    spans: list[Span]
    start_times_s: list[float]  # earliest time each hop has free cache slots (>= now_s)

    @property
    def start_s(self) -> float:
        """When the session can actually start: every hop must have its slots."""
        return max(self.start_times_s, default=0.0)


@dataclass
class _ServerState:
    block_range: BlockRange
    total_slots: int  # block-sessions of attention cache: one session running k blocks here takes k slots
    announced_free: int | None = None  # live swarm: free slots the server announced (overrides our count)
    announced_sessions: int = 0  # live swarm: sessions the server announced running (ours included, once seen)
    running: dict[str, tuple[float, int]] = field(default_factory=dict)  # session -> (until_s, slots)
    used: int = 0  # sum of slots in `running`, kept incrementally

    def hold(self, session_id: str, until_s: float, slots: int) -> None:
        self.running[session_id] = (until_s, slots)
        self.used += slots

    def drop(self, session_id: str) -> None:
        entry = self.running.pop(session_id, None)
        if entry is not None:
            self.used -= entry[1]

    def sessions(self) -> int:
        """Sessions sharing this server's compute: what it announced, or at least the ones we admitted."""
        return max(self.announced_sessions, len(self.running))

    def free_slots(self) -> int:
        mine = self.total_slots - self.used
        return mine if self.announced_free is None else min(mine, self.announced_free)

    def earliest_start_s(self, slots: int, now_s: float) -> float:
        """Earliest time >= now_s with `slots` free: now if they are free, else the completion time of the
        running session whose release frees enough (sessions release in completion order)."""
        free = self.free_slots()
        if free >= slots:
            return now_s
        if slots > self.total_slots:
            return math.inf
        for until_s, used in sorted(self.running.values()):
            free += used
            if free >= slots:
                return max(now_s, until_s)
        return math.inf  # announced load we cannot see ending: no estimate


class WaitingAwareRouter:
    """WS-RR: shortest path where each hop also pays the wait until its server has free cache slots.

    Time is whatever clock the caller uses (simulated seconds or time.monotonic()); the router never reads
    a clock. It keeps one record per admitted session; callers must `release` or `expire` them.

    Compute contention: with WS-RR a hop's per-block cost is multiplied by f(b + 1), b the sessions running on
    its server (`PerfModel.load_factor`: a CPU server's step grows with the sessions it batches; f = 1 for
    profiles without that measurement, the paper's GPU servers). The new session pays for the load it finds,
    not for what it adds to the others' steps (WS-RR is the client's own cheapest route).
    """

    def __init__(self, perf: PerfModel, num_blocks: int) -> None:
        self.perf = perf
        self.num_blocks = num_blocks
        self._servers: dict[str, _ServerState] = {}
        self._sessions: dict[str, tuple[float, list[str]]] = {}  # session -> (until_s, servers it holds)
        # hop graphs by (window, excluded servers): rebuilt after any change of ranges
        self._graphs: dict[tuple[tuple[int, int], frozenset[str]], HopGraph] = {}
        self._costs: dict[tuple[str, int, int], tuple[dict[str, float], dict[str, float]]] = {}  # affine hop costs

    def refresh(self) -> None:
        """Forget cached hop graphs and hop costs (call after changing perf profiles or RTTs)."""
        self._graphs.clear()
        self._costs.clear()

    # -- swarm state --------------------------------------------------------------------------------------
    def set_server(self, server_id: str, block_range: BlockRange, total_slots: int) -> None:
        if total_slots < 0:
            raise ValueError(f"server {server_id}: total_slots must be >= 0, got {total_slots}")
        if server_id not in self.perf.profiles:
            raise PlanningError(f"server {server_id} has no compute profile in the performance model")
        old = self._servers.get(server_id)
        state = _ServerState(block_range, total_slots)
        for sid, (until_s, slots) in (old.running.items() if old else ()):
            state.hold(sid, until_s, slots)
        self._servers[server_id] = state
        self.refresh()

    def set_load(self, server_id: str, free_slots: int, sessions: int | None = None) -> None:
        """Live swarm: the server's announced free slots (includes other clients' sessions we cannot see) and
        the sessions it runs (their compute contention)."""
        state = self._servers[server_id]
        state.announced_free = max(0, int(free_slots))
        if sessions is not None:
            state.announced_sessions = max(0, int(sessions))

    def remove_server(self, server_id: str) -> None:
        self._servers.pop(server_id, None)
        self.refresh()

    @property
    def ranges(self) -> dict[str, BlockRange]:
        return {sid: st.block_range for sid, st in self._servers.items()}

    def free_slots(self, server_id: str) -> int:
        return self._servers[server_id].free_slots()

    def earliest_start_s(self, server_id: str, slots: int, now_s: float) -> float:
        return self._servers[server_id].earliest_start_s(slots, now_s)

    # -- routing ------------------------------------------------------------------------------------------
    def graph(self, window: BlockRange | None = None, exclude: frozenset[str] = frozenset()) -> HopGraph:
        """The hop graph over blocks `window` (default: the whole model), shifted to start at 0, without the
        servers in `exclude`. Raises MissingBlocks (in model block numbers) if they leave blocks uncovered."""
        key = ((window.start, window.end) if window else (0, self.num_blocks), exclude)
        graph = self._graphs.get(key)
        if graph is None:
            w = BlockRange(*key[0])
            ranges = {sid: BlockRange(max(st.block_range.start, w.start) - w.start,
                                      min(st.block_range.end, w.end) - w.start)
                      for sid, st in self._servers.items()
                      if sid not in exclude and st.block_range.start < w.end and st.block_range.end > w.start}
            try:
                graph = HopGraph(ranges, w.length)
            except MissingBlocks as exc:
                raise MissingBlocks([b + w.start for b in exc.missing]) from None
            if len(self._graphs) > 64:  # a live client's bans come and go: keep the cache small
                self._graphs.clear()
            self._graphs[key] = graph
        return graph

    def hop_costs(self, client: str, l_in: int, l_out: int) -> tuple[dict[str, float], dict[str, float]]:
        """BPRR hop cost of every server for this client as fixed + per_block * k (it is affine in k)."""
        key = (client, l_in, l_out)
        if key not in self._costs:
            terms = {s: self.perf.hop_cost_terms(client, s, l_in, l_out) for s in self._servers}
            self._costs[key] = ({s: t[0] for s, t in terms.items()}, {s: t[1] for s, t in terms.items()})
        return self._costs[key]

    def route(self, client: str, now_s: float, l_in: int, l_out: int, waiting_aware: bool = True,
              window: BlockRange | None = None, exclude: frozenset[str] = frozenset(),
              prefix_held: Mapping[str, int] | None = None) -> RoutedHops:
        """Cheapest chain for one new request; edge cost = (start - now) + BPRR hop cost with compute x f(load).

        waiting_aware=False routes on hop costs alone (plain shortest path) but still reports start times.
        window: route only blocks [window.start, window.end) (a failover re-routes one broken span); exclude:
        servers not to use. prefix_held: prompt tokens a server holds in its prefix cache, priced off its hop
        (perf/prefix.py: their transfer and prefill, before the load factor). Raises MissingBlocks if the servers do
        not cover the blocks, or if every chain waits forever (announced load with no known end).
        """
        fixed, per_block = self.hop_costs(client, l_in, l_out)
        if prefix_held:
            fixed, per_block = self._minus_prefix(client, fixed, per_block, prefix_held)
        graph = self.graph(window, exclude)
        if waiting_aware:
            per_block = self.loaded_per_block(per_block)
            free = {sid: st.free_slots() for sid, st in self._servers.items()}
            wait = lambda sid, k: self._servers[sid].earliest_start_s(k, now_s) - now_s  # noqa: E731
            spans = graph.shortest_affine(fixed, per_block, free, wait)
        else:
            spans = graph.shortest_affine(fixed, per_block)
        shift = window.start if window else 0
        spans = [Span(s.server_id, s.start + shift, s.end + shift) for s in spans] if shift else spans
        starts = [self._servers[s.server_id].earliest_start_s(s.length, now_s) for s in spans]
        return RoutedHops(spans, starts)

    def _minus_prefix(self, client: str, fixed: Mapping[str, float], per_block: Mapping[str, float],
                      held: Mapping[str, int]) -> tuple[dict[str, float], dict[str, float]]:
        fixed, per_block = dict(fixed), dict(per_block)
        for sid, n_tokens in held.items():
            if sid in fixed:
                saved_fixed, saved_per_block = prefix_saving_terms(self.perf, client, sid, n_tokens)
                fixed[sid] = max(fixed[sid] - saved_fixed, 0.0)
                per_block[sid] = max(per_block[sid] - saved_per_block, 0.0)
        return fixed, per_block

    def loaded_per_block(self, per_block: Mapping[str, float]) -> dict[str, float]:
        """Each server's per-block hop cost for one more session: x f(sessions running there + 1)."""
        f = self.perf.load_factor
        return {sid: c * f(sid, 1 + self._servers[sid].sessions()) for sid, c in per_block.items()}

    def contended(self) -> bool:
        """True if some server's step time grows with its load (then load, not only slots, steers WS-RR)."""
        return any(self.perf.profiles[sid].contended for sid in self._servers)

    # -- sessions -----------------------------------------------------------------------------------------
    def admit(self, session_id: str, spans: list[Span], until_s: float) -> None:
        """Reserve each hop's slots (its block count) until `until_s`, the session's completion time."""
        if session_id in self._sessions:
            raise ValueError(f"session {session_id} already admitted")
        for s in spans:
            self._servers[s.server_id].hold(session_id, until_s, s.length)
        self._sessions[session_id] = (until_s, [s.server_id for s in spans])

    def release(self, session_id: str) -> None:
        _, servers = self._sessions.pop(session_id, (0.0, []))
        for sid in servers:
            st = self._servers.get(sid)
            if st is not None:
                st.drop(session_id)

    def expire(self, now_s: float) -> list[str]:
        """Release every session whose completion time is <= now_s; returns their ids."""
        done = [sid for sid, (until_s, _) in self._sessions.items() if until_s <= now_s]
        for sid in done:
            self.release(sid)
        return done

    @property
    def active_sessions(self) -> int:
        return len(self._sessions)
