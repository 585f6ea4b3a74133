"""`make_plan`: placement + routing + predicted times for a topology. What `swarmlm plan` prints.

Prediction: R requests (the target concurrency) arrive together at t = 0, issued round-robin by the clients,
and are routed one after another by the chosen router, each holding cache slots on its route until it
completes. A request that finds no free slots waits (WS-RR start times); its per-token time is
(wait + request time) / l_out, the paper's metric. Clients without a planned request (R < clients) get the
route they would take in the loaded swarm but do not enter the averages.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Literal

from swarmlm.errors import PlanningError
from swarmlm.planner.hop_graph import HopCost, uncovered_blocks
from swarmlm.planner.placement import (Placement, PlacementFn, PlacementOptions, PlacementResult,
                                       blocks_for_concurrency, cache_slots, choose_concurrency, is_feasible,
                                       max_feasible_concurrency, place_cg_bprr, place_petals, request_clients)
from swarmlm.planner.routing import WaitingAwareRouter
from swarmlm.planner.topology import Topology
from swarmlm.types import Span

Algorithm = Literal["petals", "cg-bprr", "milp"]


def _place_milp(topology: Topology, concurrency: int, options: PlacementOptions = PlacementOptions()) -> PlacementResult:
    from swarmlm.planner.milp import place_milp  # scipy is imported only when the MILP is asked for
    return place_milp(topology, concurrency, options)


PLACEMENTS: dict[str, PlacementFn] = {"petals": place_petals, "cg-bprr": place_cg_bprr, "milp": _place_milp}

Routing = Literal["shortest", "waiting-aware", "petals"]
PETALS_OVERHEAD_S = 0.018  # Petals' routing adds 18 ms per hop (the authors' simulator)
PETALS_NO_CACHE_PENALTY_S = 10.0  # and 10 s for a server whose cache is full


@dataclass(frozen=True)
class Plan:
    algorithm: str
    routing: str
    concurrency: int  # R the placement was planned for
    placement: Placement
    routes: dict[str, list[Span]]  # client -> its route
    per_token_s: float  # mean over the planned requests of (wait + request time) / l_out
    ttft_s: float  # mean time to first token (wait + prompt through every hop)
    decode_s: float  # mean steady-state time per generated token (one decode step along the route)
    wait_s: float  # mean wait for cache slots
    solve_s: float  # placement + routing wall-clock time
    gap: float | None = None  # milp optimality gap
    bound_s: float | None = None  # cg-bprr Theorem-2 bound on the per-token decode time
    notes: tuple[str, ...] = field(default=())

    def to_json(self) -> dict:
        return {
            "algorithm": self.algorithm, "routing": self.routing, "concurrency": self.concurrency,
            "placement": {s: [r.start, r.end] for s, r in sorted(self.placement.items(), key=lambda kv: (kv[1], kv[0]))},
            "routes": {c: [s.server_id for s in spans] for c, spans in self.routes.items()},
            "spans": {c: [[s.server_id, s.start, s.end] for s in spans] for c, spans in self.routes.items()},
            "predicted": {"per_token_s": self.per_token_s, "ttft_s": self.ttft_s, "decode_s": self.decode_s,
                          "wait_s": self.wait_s},
            "solve_s": self.solve_s, "gap": self.gap, "bound_s": self.bound_s, "notes": list(self.notes),
        }


def _runs(blocks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    runs: list[list[int]] = []
    for b in sorted(blocks):
        if runs and b == runs[-1][1] + 1:
            runs[-1][1] = b
        else:
            runs.append([b, b])
    return ", ".join(str(a) if a == z else f"{a}-{z}" for a, z in runs)


def plan_concurrency(topology: Topology) -> int:
    """R: the workload's, or from the arrival rate (Little + one std) with T = one request on a lone chain."""
    wl = topology.workload
    if wl.concurrency is not None:
        return wl.concurrency
    # memory cap: the largest R the feasibility condition allows. The paper's closed form R_max
    # (placement.max_concurrency) estimates it but ignores block rounding: it is 0 on small instances that can
    # host sessions, and can exceed what CG-BPRR can place.
    cap = max_feasible_concurrency(topology.servers, topology.model)
    if topology.max_concurrency is not None:
        cap = min(cap, topology.max_concurrency)
    if cap < 1:
        raise PlanningError("servers have too little memory for even one session across the model")
    # T from the R = 1 placement: the fastest a lone request can be served
    single = PLACEMENTS["cg-bprr"](topology, 1, PlacementOptions())
    router = _router(topology, single.ranges)
    times = [topology.perf.request_time_s(c.name, router.route(c.name, 0.0, wl.input_tokens, wl.output_tokens,
                                                               waiting_aware=False).spans,
                                          wl.input_tokens, wl.output_tokens) for c in topology.clients]
    return choose_concurrency(wl.arrival_rate or 0.0, sum(times) / len(times), cap)


def _router(topology: Topology, ranges: Placement) -> WaitingAwareRouter:
    """A router over `ranges`, each server's cache slots from its memory left after the weights."""
    router = WaitingAwareRouter(topology.perf, topology.model.num_blocks)
    specs = {s.name: s for s in topology.servers}
    for name, rng in ranges.items():
        router.set_server(name, rng, cache_slots(specs[name].memory_bytes, topology.model, rng.length))
    return router


def petals_hop_cost(router: WaitingAwareRouter, client: str) -> HopCost:
    """Petals' own routing estimate: RTT/2 + 18 ms + per-block decode, + 10 s where the cache is full."""
    perf = router.perf

    def cost(_prev: str | None, server: str, start: int, end: int) -> float:
        k = end - start
        c = perf.network.rtt_s(client, server) / 2 + PETALS_OVERHEAD_S + perf.profiles[server].decode_s * k
        return c + (PETALS_NO_CACHE_PENALTY_S if router.free_slots(server) < k else 0.0)
    return cost


def make_plan(topology: Topology, algorithm: Algorithm, routing: Routing | None = None, *,
              concurrency: int | None = None, options: PlacementOptions = PlacementOptions()) -> Plan:
    """Place blocks with `algorithm`, route R requests with `routing` (default: petals routing for petals,
    shortest path otherwise), and predict per-token time and TTFT with the shared PerfModel."""
    if algorithm not in PLACEMENTS:
        raise PlanningError(f"unknown algorithm {algorithm!r} (choose from {', '.join(PLACEMENTS)})")
    routing = routing or ("petals" if algorithm == "petals" else "shortest")
    if routing not in ("shortest", "waiting-aware", "petals"):
        raise PlanningError(f"unknown routing {routing!r} (shortest, waiting-aware or petals)")
    started = time.perf_counter()
    R = concurrency or plan_concurrency(topology)
    if algorithm == "cg-bprr" and not is_feasible(topology.servers, topology.model, R):  # milp checks exactly
        held = sum(blocks_for_concurrency(s.memory_bytes, topology.model, R) for s in topology.servers)
        raise PlanningError(f"the model cannot be covered with room for R={R} concurrent sessions: the servers hold "
                            f"{held} of {topology.model.num_blocks} blocks (needs sum_j min(floor(M_j/(s_m+s_c R)), L)"
                            f" >= L; lower the concurrency or add memory)")
    placed: PlacementResult = PLACEMENTS[algorithm](topology, R, options)
    missing = uncovered_blocks(placed.ranges, topology.model.num_blocks)
    if missing:
        raise PlanningError(f"{algorithm} placement leaves blocks {_runs(missing)} of {topology.model.num_blocks} "
                            f"uncovered ("
                            + ("Petals keeps a 2 GiB reserve and caches for 4096 tokens per block; " if algorithm == "petals"
                               else "") + "the servers' memory is too small for this model)")
    routes, stats = _route_requests(topology, placed, R, routing)
    # milp routes every planned request itself; report that instead of a router that was not used
    return Plan(algorithm, "milp" if placed.routes else routing, R, placed.ranges, routes, *stats,
                solve_s=time.perf_counter() - started, gap=placed.gap, bound_s=placed.bound_s, notes=placed.notes)


def _route_requests(topology: Topology, placed: PlacementResult, R: int,
                    routing: Routing) -> tuple[dict[str, list[Span]], tuple[float, float, float, float]]:
    wl, perf = topology.workload, topology.perf
    l_in, l_out = wl.input_tokens, wl.output_tokens
    router = _router(topology, placed.ranges)
    routes: dict[str, list[Span]] = {}
    per_token, ttft, decode, wait = [], [], [], []
    for r, client in enumerate(request_clients(topology.clients, R)):
        if placed.routes:  # milp: the solver's own route for this request
            spans = list(placed.routes[r][1])
            starts = [router.earliest_start_s(s.server_id, s.length, 0.0) for s in spans]
        elif routing == "petals":
            spans = router.graph().shortest(petals_hop_cost(router, client))
            starts = [router.earliest_start_s(s.server_id, s.length, 0.0) for s in spans]
        else:
            spans, starts = router.route(client, 0.0, l_in, l_out, waiting_aware=(routing == "waiting-aware"))
        start = max(starts)
        if not math.isfinite(start):
            raise PlanningError(f"request {r} of client {client}: a server on its route can never host it")
        total = perf.request_time_s(client, spans, l_in, l_out)
        router.admit(f"r{r}", spans, start + total)
        routes.setdefault(client, spans)
        per_token.append((start + total) / l_out)
        ttft.append(start + perf.ttft_s(client, spans, l_in))
        decode.append(perf.decode_step_s(client, spans))
        wait.append(start)
    for c in topology.clients:  # clients with no planned request: their route in the loaded swarm
        if c.name not in routes:
            if routing == "petals":
                routes[c.name] = router.graph().shortest(petals_hop_cost(router, c.name))
            else:
                routes[c.name] = router.route(c.name, 0.0, l_in, l_out, waiting_aware=(routing == "waiting-aware")).spans
    n = len(per_token)
    return routes, (sum(per_token) / n, sum(ttft) / n, sum(decode) / n, sum(wait) / n)
