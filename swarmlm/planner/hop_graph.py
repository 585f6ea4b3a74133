"""The logical topology of feasible hops (client -> servers -> client) and its shortest routes.

Hop i -> j is feasible iff j.start <= i.end < j.end: j holds the first block i has not run. j then runs
[i.end, j.end). The client is a source "holding" nothing (end 0) and the route ends when block num_blocks
is reached. `shortest_route` prices hops with static costs (the planner, the paper's step 5); the waiting-aware
router (planner/routing.py) builds a `HopGraph` and adds each server's earliest free-slot time.

    HopCost = Callable[[str | None, str, int, int], float]   # (previous server or None, server, start, end) -> s
    shortest_route(ranges, num_blocks, hop_cost, exact_prev=False) -> list[Span]   # raises MissingBlocks
    HopGraph(ranges, num_blocks).shortest(hop_cost)            # same, graph built once for many routes
    bprr_hop_cost(perf, client, l_in, l_out) -> HopCost        # the paper's edge weight
"""
from __future__ import annotations

import math
from typing import Callable, Mapping

from swarmlm.errors import MissingBlocks
from swarmlm.perf.model import PerfModel
from swarmlm.types import BlockRange, Span

HopCost = Callable[[str | None, str, int, int], float]


def uncovered_blocks(ranges: Mapping[str, BlockRange], num_blocks: int) -> list[int]:
    covered = [False] * num_blocks
    for r in ranges.values():
        for b in range(r.start, min(r.end, num_blocks)):
            covered[b] = True
    return [b for b, ok in enumerate(covered) if not ok]


def shortest_route(ranges: Mapping[str, BlockRange], num_blocks: int, hop_cost: HopCost,
                   exact_prev: bool = False) -> list[Span]:
    """Cheapest chain of spans covering [0, num_blocks); raises MissingBlocks naming uncovered blocks.

    With a hop cost that ignores the previous server (the BPRR model: the client relays), the state is just
    "blocks done so far", so a DP over block positions is exact and costs O(L * servers covering a block).
    `exact_prev=True` runs the DP over servers instead (exact for costs that depend on the previous server,
    e.g. direct server-to-server links), O(feasible hops). `prev` passed to hop_cost is the server that
    reached the position most cheaply (None at block 0).
    """
    graph = HopGraph(ranges, num_blocks)
    return _shortest_by_server(graph.ranges, num_blocks, hop_cost) if exact_prev else graph.shortest(hop_cost)


class HopGraph:
    """The feasible-hop DAG of one placement, indexed by block position; build once, route many times."""

    def __init__(self, ranges: Mapping[str, BlockRange], num_blocks: int) -> None:
        missing = uncovered_blocks(ranges, num_blocks)
        if missing:
            raise MissingBlocks(missing)
        self.ranges = dict(ranges)
        self.num_blocks = num_blocks
        # covering[b]: servers j with j.start <= b < j.end, i.e. that can take over at position b
        self.covering: list[list[tuple[str, int]]] = [[] for _ in range(num_blocks)]
        # servers holding the same range: an affine cost lets all but a few be skipped (shortest_affine)
        self.groups: dict[tuple[int, int], list[str]] = {}
        for sid, r in self.ranges.items():
            end = min(r.end, num_blocks)
            self.groups.setdefault((r.start, end), []).append(sid)
            for b in range(r.start, end):
                self.covering[b].append((sid, end))

    def shortest(self, hop_cost: HopCost) -> list[Span]:
        L = self.num_blocks
        dist = [math.inf] * (L + 1)
        back: list[tuple[int, str] | None] = [None] * (L + 1)  # position -> (previous position, server)
        dist[0] = 0.0
        for b in range(L):
            if dist[b] == math.inf:
                continue
            prev = back[b][1] if back[b] else None
            for sid, end in self.covering[b]:
                cost = dist[b] + hop_cost(prev, sid, b, end)
                if cost < dist[end]:
                    dist[end], back[end] = cost, (b, sid)
        return _unwind(back, L)

    def shortest_affine(self, fixed_s: Mapping[str, float], per_block_s: Mapping[str, float],
                        free_slots: Mapping[str, int] | None = None,
                        wait_s: Callable[[str, int], float] | None = None) -> list[Span]:
        """Fast path of `shortest` for hop cost fixed_s[j] + per_block_s[j] * k (+ wait_s(j, k) when the hop
        needs more than free_slots[j] slots). Same optimal cost, without a Python call per candidate hop.

        Among servers holding the same range that never wait, one is dominated by another with no larger
        fixed and per-block cost (cheaper for every k), so only the Pareto front of each range is searched:
        on 1,000 servers with ~100 distinct ranges that cuts the candidates about tenfold."""
        L = self.num_blocks
        covering: list[list[tuple[str, int]]] = [[] for _ in range(L)]
        for (start, end), sids in self.groups.items():
            keep = sids if len(sids) == 1 else self._pareto(sids, end - start, fixed_s, per_block_s, free_slots)
            for sid in keep:
                for b in range(start, end):
                    covering[b].append((sid, end))
        dist = [math.inf] * (L + 1)
        back: list[tuple[int, str] | None] = [None] * (L + 1)
        dist[0] = 0.0
        for b in range(L):
            here = dist[b]
            if here == math.inf:
                continue
            for sid, end in covering[b]:
                k = end - b
                cost = here + fixed_s[sid] + per_block_s[sid] * k
                if free_slots is not None and k > free_slots[sid]:
                    cost += wait_s(sid, k)
                if cost < dist[end]:
                    dist[end], back[end] = cost, (b, sid)
        return _unwind(back, L)

    @staticmethod
    def _pareto(sids: list[str], length: int, fixed_s: Mapping[str, float], per_block_s: Mapping[str, float],
                free_slots: Mapping[str, int] | None) -> list[str]:
        """Servers of one range that can be cheapest for some k: every server that might wait (its cost has
        an extra term), plus the (per_block, fixed) Pareto front of those that never wait."""
        waiting: list[str] = []
        cheapest: dict[float, tuple[float, str]] = {}  # per-block cost -> (smallest fixed cost, server)
        for sid in sids:
            if free_slots is not None and free_slots[sid] < length:
                waiting.append(sid)
                continue
            pb, fx = per_block_s[sid], fixed_s[sid]
            if pb not in cheapest or fx < cheapest[pb][0]:
                cheapest[pb] = (fx, sid)
        front: list[str] = []
        best_fixed = math.inf
        for pb in sorted(cheapest):  # few distinct hardware profiles: increasing per-block cost
            fx, sid = cheapest[pb]
            if fx < best_fixed:  # keep only strictly smaller fixed costs
                front.append(sid)
                best_fixed = fx
        return waiting + front


def _unwind(back: list[tuple[int, str] | None], num_blocks: int) -> list[Span]:
    spans: list[Span] = []
    pos = num_blocks
    while pos > 0:
        step = back[pos]
        if step is None:  # cannot happen when all blocks are covered; kept as a guard
            raise MissingBlocks(list(range(pos)), "no chain reaches this position")
        start, sid = step
        spans.append(Span(sid, start, pos))
        pos = start
    spans.reverse()
    return spans


def _shortest_by_server(ranges: Mapping[str, BlockRange], num_blocks: int, hop_cost: HopCost) -> list[Span]:
    by_end: dict[int, list[str]] = {}
    for sid, r in ranges.items():
        by_end.setdefault(min(r.end, num_blocks), []).append(sid)
    order = sorted(ranges, key=lambda s: min(ranges[s].end, num_blocks))
    dist: dict[str, float] = {}
    back: dict[str, str | None] = {}
    for j in order:
        r = ranges[j]
        end = min(r.end, num_blocks)
        best, arg = (hop_cost(None, j, 0, end), None) if r.start == 0 else (math.inf, None)
        for e in range(r.start, end):  # predecessors end inside [j.start, j.end)
            for i in by_end.get(e, ()):
                if i in dist and dist[i] < math.inf:
                    c = dist[i] + hop_cost(i, j, e, end)
                    if c < best:
                        best, arg = c, i
        dist[j], back[j] = best, arg
    finals = [s for s in ranges if min(ranges[s].end, num_blocks) == num_blocks and dist[s] < math.inf]
    last = min(finals, key=lambda s: dist[s])
    spans: list[Span] = []
    node: str | None = last
    while node is not None:
        prev = back[node]
        start = min(ranges[prev].end, num_blocks) if prev is not None else 0
        spans.append(Span(node, start, min(ranges[node].end, num_blocks)))
        node = prev
    spans.reverse()
    return spans


def bprr_hop_cost(perf: PerfModel, client: str, l_in: int, l_out: int) -> HopCost:
    """The paper's edge weight for one client: (tI + (l_out-1) t) + (tauI + (l_out-1) tau) * k."""
    def cost(_prev: str | None, server: str, start: int, end: int) -> float:
        return perf.hop_cost_s(client, server, end - start, l_in, l_out)
    return cost
