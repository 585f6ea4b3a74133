"""Which servers a session goes through: the swarm as the client sees it, and the choice of a chain.

Costs come from the shared performance model (announced compute profiles + RTTs this client measured); the
chain is the planner's shortest path, plus, with waiting-aware routing, each server's wait for free cache and
the load of sessions already running there (announced, and this client's own).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from swarmlm.config import ClientConfig
from swarmlm.errors import MissingBlocks
from swarmlm.perf.model import ComputeProfile, Network, PerfModel
from swarmlm.planner.routing import shortest_route
from swarmlm.swarm.records import ServerRecord
from swarmlm.types import BlockRange, Route, Span

log = logging.getLogger(__name__)
CLIENT = "client"  # this client's node name in the performance model


@dataclass
class Ban:
    until_s: float
    failures: int


@dataclass
class SwarmView:
    """Live servers (from the DHT or a fixed list), their RTTs, and servers this client avoids for a while."""

    config: ClientConfig
    records: dict[str, ServerRecord] = field(default_factory=dict)
    rtt_s: dict[str, float] = field(default_factory=dict)  # server id -> measured round trip
    bans: dict[str, Ban] = field(default_factory=dict)
    local_sessions: dict[str, int] = field(default_factory=dict)  # server id -> this client's open sessions
    refreshed_s: float = 0.0

    def update(self, records: dict[str, ServerRecord]) -> None:
        self.records = records
        self.refreshed_s = time.monotonic()

    def ban(self, server_id: str) -> float:
        """Avoid a failed server, longer each time it fails again (bounded exponential backoff)."""
        prev = self.bans.get(server_id)
        failures = prev.failures + 1 if prev else 1
        duration = min(self.config.ban_base_s * 2 ** (failures - 1), self.config.ban_max_s)
        self.bans[server_id] = Ban(time.monotonic() + duration, failures)
        return duration

    def usable(self) -> dict[str, ServerRecord]:
        now = time.monotonic()
        return {sid: r for sid, r in self.records.items() if sid not in self.bans or self.bans[sid].until_s <= now}


def perf_model(view: SwarmView, records: dict[str, ServerRecord], default_rtt_s: float = 0.005) -> PerfModel:
    network = Network(default_rtt_s=default_rtt_s)
    for sid in records:
        if sid in view.rtt_s:
            network.set_link(CLIENT, sid, view.rtt_s[sid])
    profiles = {
        sid: ComputeProfile(prefill_a_s=r.prefill_a_s, prefill_b_s=r.prefill_b_s, decode_s=r.decode_s)
        for sid, r in records.items()
    }
    return PerfModel(profiles, network)


def choose_route(
    view: SwarmView, start: int, end: int, l_in: int, l_out: int, batch: int = 1, max_length: int = 0,
    waiting_aware: bool = True, exclude: frozenset[str] = frozenset(),
) -> Route:
    """The cheapest chain covering blocks [start, end) with the servers this client may use."""
    records = {sid: r for sid, r in view.usable().items() if sid not in exclude and r.start < end and r.end > start}
    # clip to the window and shift it to start at 0, the shape the planner's router works on
    ranges = {sid: BlockRange(max(r.start, start) - start, min(r.end, end) - start) for sid, r in records.items()}
    perf = perf_model(view, records)
    need_tokens = max(max_length, l_in + l_out)

    def cost(_prev: str | None, sid: str, s: int, e: int) -> float:
        k = e - s
        hop = perf.hop_cost_s(CLIENT, sid, k, l_in, l_out)
        if not waiting_aware:
            return hop
        r = records[sid]
        # sessions already running there share its compute (announced by the server, plus our own not yet seen)
        load = r.active_sessions + view.local_sessions.get(sid, 0)
        compute = k * (r.prefill_a_s * l_in + r.prefill_b_s + (l_out - 1) * r.decode_s)
        wait = 0.0
        need = r.session_bytes_per_block_token * k * batch * need_tokens
        if r.cache_bytes_total and need > r.cache_bytes_free:
            # no room now: expect to wait about one request time for a session to finish there
            wait = hop * (1 + load)
        return hop + load * compute + wait

    try:
        spans = shortest_route(ranges, end - start, cost)
    except MissingBlocks as exc:
        raise MissingBlocks([b + start for b in exc.missing]) from None
    spans = tuple(Span(s.server_id, s.start + start, s.end + start, records[s.server_id].address) for s in spans)
    estimate = sum(perf.decode_hop_s(CLIENT, s.server_id, s.length) for s in spans)
    return Route(spans, estimated_s=estimate)
