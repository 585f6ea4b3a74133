"""Prefix caches in the simulator: which servers hold which shared prompt prefixes (server/prefix_cache.py).

A session that finishes leaves its request's prefix on every server of its route; a later request of the same
prefix starts from it when every server of its route holds it (the real client starts from the prefix all its
spans hold), its prefill priced by the one performance model (perf/prefix.py), and the router prices the hops of
servers holding it as the live client's does (WaitingAwareRouter.route's prefix_held). Entries are never evicted
here: a bound on what the simulated servers keep is left to a later model.
"""
from __future__ import annotations

from collections import defaultdict

from swarmlm.sim.arrivals import SimRequest
from swarmlm.types import Route


class PrefixStore:
    def __init__(self) -> None:
        self.held: defaultdict[str, set[str]] = defaultdict(set)  # server id -> prefix ids it holds
        self.hits = 0  # requests that started from a cached prefix
        self.hit_tokens = 0

    def by_server(self, req: SimRequest) -> dict[str, int]:
        """Prompt tokens each server holds for `req` (for the router)."""
        if not req.prefix_id:
            return {}
        return {sid: req.prefix_tokens for sid, ids in self.held.items() if req.prefix_id in ids}

    def start(self, req: SimRequest, route: Route) -> int:
        """Prompt tokens `req` does not prefill on `route` (its prefix, if every server there holds it)."""
        if not req.prefix_id or not all(req.prefix_id in self.held[s.server_id] for s in route.spans):
            return 0
        self.hits += 1
        self.hit_tokens += req.prefix_tokens
        return req.prefix_tokens

    def finished(self, req: SimRequest, route: Route) -> None:
        if req.prefix_id:
            for span in route.spans:
                self.held[span.server_id].add(req.prefix_id)
