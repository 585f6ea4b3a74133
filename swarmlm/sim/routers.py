"""The seam between the simulator and the planner's routing code, the code the live client runs too.

The simulator never routes by itself: `PlannerRouter` asks `swarmlm.planner.routing` for every route and tells
its `WaitingAwareRouter` when sessions start and end. The live client routes with the same class
(client/router.py), fed from announced records and measured RTTs, admitting and releasing its own sessions the
same way. Both price a hop's compute at the load the new session finds (the performance model's f(b)), the same
formula the simulated servers step with (sim/simulator.py).
`SimRouter` is the small protocol the session events need, so a test can plug in a fixed route.

Two speed-ups, both exact, because routing, not the event loop, is the cost of a 1,000-server run
(milliseconds per WS-RR search):
- `MemoPerfModel` caches hop costs: profiles and links do not change during a simulation.
- waiting-aware fast path: if every hop of the static shortest route p* has free slots now, p* is also the
  WS-RR route: WS-RR cost(p) = static(p) + waits(p) >= static(p) >= static(p*) = WS-RR cost(p*). The full
  WS-RR search runs only when p* would wait (equal-cost ties may resolve differently; both are optimal).
  Exact only when load does not change compute (f = 1): with contended servers (CPU profiles) every WS-RR
  route is a full search.
"""
from __future__ import annotations

from typing import Literal, Protocol

from swarmlm.perf.model import PerfModel
from swarmlm.planner.plan import petals_hop_cost
from swarmlm.planner.routing import WaitingAwareRouter
from swarmlm.sim.arrivals import SimRequest
from swarmlm.types import BlockRange, Route

RoutingMode = Literal["shortest", "waiting-aware", "petals"]
ROUTING_MODES: tuple[str, ...] = ("shortest", "waiting-aware", "petals")


class SimRouter(Protocol):
    def choose(self, req: SimRequest, now_s: float) -> Route: ...

    def admitted(self, req: SimRequest, route: Route, now_s: float, until_s: float) -> None: ...

    def released(self, req: SimRequest, now_s: float) -> None: ...


class FixedRouter:
    """Every request takes the same route (tests, and what-if runs of one chain)."""

    def __init__(self, route: Route) -> None:
        self.route = route

    def choose(self, req: SimRequest, now_s: float) -> Route:
        return self.route

    def admitted(self, req: SimRequest, route: Route, now_s: float, until_s: float) -> None:
        pass

    def released(self, req: SimRequest, now_s: float) -> None:
        pass


class MemoPerfModel(PerfModel):
    """The same PerfModel with hop times cached per (client, server, blocks, l_in[, l_out])."""

    def __init__(self, perf: PerfModel) -> None:
        super().__init__(perf.profiles, perf.network, perf.hidden_bytes_per_token, perf.message_overhead_s)
        self._prefill: dict[tuple, float] = {}
        self._decode: dict[tuple, float] = {}
        self._hop: dict[tuple, float] = {}

    def prefill_hop_s(self, client: str, server: str, blocks: int, l_in: int, sessions: int = 1) -> float:
        key = (client, server, blocks, l_in, sessions)
        v = self._prefill.get(key)
        if v is None:
            v = self._prefill[key] = super().prefill_hop_s(client, server, blocks, l_in, sessions)
        return v

    def decode_hop_s(self, client: str, server: str, blocks: int, sessions: int = 1) -> float:
        key = (client, server, blocks, sessions)
        v = self._decode.get(key)
        if v is None:
            v = self._decode[key] = super().decode_hop_s(client, server, blocks, sessions)
        return v

    def hop_cost_s(self, client: str, server: str, blocks: int, l_in: int, l_out: int) -> float:
        key = (client, server, blocks, l_in, l_out)
        v = self._hop.get(key)
        if v is None:
            v = self._hop[key] = super().hop_cost_s(client, server, blocks, l_in, l_out)
        return v


class PlannerRouter:
    """Drives the planner's routers: route on arrival/retry, admit on start, release on finish.

    shortest: plain BPRR shortest path (static costs, so computed once per (client, l_in, l_out) and reused);
    waiting-aware: WS-RR (`WaitingAwareRouter.route`); petals: Petals' own cost (plan.py), which adds 18 ms a
    hop and 10 s where the router sees a full cache.
    """

    def __init__(self, router: WaitingAwareRouter, mode: RoutingMode, fast_path: bool = True) -> None:
        if mode not in ROUTING_MODES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_MODES)}, got {mode!r}")
        self.router = router
        self.mode = mode
        # the shortcut assumes WS-RR cost >= static cost only through waits: not so when load raises compute
        self.fast_path = fast_path and not router.contended()
        self._static: dict[tuple[str, int, int], Route] = {}
        self.full_searches = 0  # WS-RR searches that the fast path could not avoid (reported in the summary)
        self.prefixes = None  # the simulator's PrefixStore (sim/prefixes.py): servers' cached prefixes, priced

    @classmethod
    def build(cls, perf: PerfModel, num_blocks: int, servers: list[tuple[str, BlockRange, int]],
              mode: RoutingMode, fast_path: bool = True) -> "PlannerRouter":
        """A router that knows every simulated server: (server_id, block range, total slots)."""
        router = WaitingAwareRouter(MemoPerfModel(perf), num_blocks)
        for server_id, block_range, slots in servers:
            router.set_server(server_id, block_range, slots)
        return cls(router, mode, fast_path)

    def _shortest(self, req: SimRequest, now_s: float) -> Route:
        key = (req.client_id, req.input_tokens, req.output_tokens)
        route = self._static.get(key)
        if route is None:
            hops = self.router.route(req.client_id, now_s, req.input_tokens, req.output_tokens, waiting_aware=False)
            route = self._static[key] = Route(tuple(hops.spans))
        return route

    def choose(self, req: SimRequest, now_s: float) -> Route:
        if self.mode == "petals":
            return Route(tuple(self.router.graph().shortest(petals_hop_cost(self.router, req.client_id))))
        static = self._shortest(req, now_s)
        if self.mode == "shortest":
            return static
        held = self.prefixes.by_server(req) if self.prefixes is not None else {}
        if not held and self.fast_path and all(self.router.free_slots(s.server_id) >= s.length for s in static.spans):
            return static
        self.full_searches += 1
        hops = self.router.route(req.client_id, now_s, req.input_tokens, req.output_tokens, waiting_aware=True,
                                 prefix_held=held)
        return Route(tuple(hops.spans))

    def admitted(self, req: SimRequest, route: Route, now_s: float, until_s: float) -> None:
        self.router.admit(str(req.request_id), list(route.spans), until_s)

    def released(self, req: SimRequest, now_s: float) -> None:
        self.router.release(str(req.request_id))
