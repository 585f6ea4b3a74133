"""One call from a topology to simulated latencies: plan with the planner, build the cluster, simulate.

    simulate_scenario(topology, "cg-bprr", "waiting-aware", arrivals=ArrivalSpec("poisson", 0.5, count=100))

The placement is `swarmlm.planner.plan.make_plan`'s (the same code `swarmlm plan` and the live swarm use),
each server's cache slots are the planner's `cache_slots` rule, and service times come from the topology's
PerfModel. A validation benchmark passes measured `profiles` (and/or a measured `network`) to predict a real
deployment with the numbers it observed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from swarmlm.perf.model import ComputeProfile, Network
from swarmlm.planner.placement import PlacementOptions, cache_slots
from swarmlm.planner.plan import Plan, make_plan
from swarmlm.planner.topology import Topology
from swarmlm.sim.arrivals import ArrivalSpec, SimRequest, generate
from swarmlm.sim.cluster import SimServerConfig
from swarmlm.sim.routers import PlannerRouter, RoutingMode
from swarmlm.sim.session import ClientBehaviour
from swarmlm.sim.simulator import SimResult, run_simulation


@dataclass(frozen=True)
class ScenarioResult:
    plan: Plan  # the planner's placement (and its own static prediction)
    sim: SimResult  # what the simulation measured
    summary: dict  # sim summary + algorithm, routing, R, solve time and the planner's prediction


def with_measurements(topology: Topology, profiles: Mapping[str, ComputeProfile] | None = None,
                      network: Network | None = None) -> Topology:
    """The topology with measured per-server compute profiles and/or a measured network swapped in."""
    if profiles:
        unknown = sorted(set(profiles) - {s.name for s in topology.servers})
        if unknown:
            raise ValueError(f"profiles given for unknown server(s) {', '.join(unknown)}")
        servers = tuple(dataclasses.replace(s, profile=profiles.get(s.name, s.profile)) for s in topology.servers)
        topology = dataclasses.replace(topology, servers=servers)
    if network is not None:
        topology = dataclasses.replace(topology, network=network)
    return topology


def default_arrivals(topology: Topology, count: int | None = None, duration_s: float | None = None) -> ArrivalSpec:
    """Poisson at the workload's arrival_rate with its token counts; `count` requests unless `duration_s`."""
    wl = topology.workload
    if wl.arrival_rate is None:
        raise ValueError("the topology's workload has no arrival_rate (needed to simulate Poisson arrivals)")
    if duration_s is None and count is None:
        count = 100
    return ArrivalSpec("poisson", wl.arrival_rate, count=count if duration_s is None else None, duration_s=duration_s,
                       input_tokens=wl.input_tokens, output_tokens=wl.output_tokens)


def build_servers(topology: Topology, plan: Plan) -> list[SimServerConfig]:
    """One simulated server per placed server; slots by the planner's memory rule (what its router assumes)."""
    specs = {s.name: s for s in topology.servers}
    return [SimServerConfig(name, rng.start, rng.end, cache_slots(specs[name].memory_bytes, topology.model, rng.length))
            for name, rng in sorted(plan.placement.items())]


def simulate_scenario(
    topology: Topology,
    algorithm: str,
    routing: RoutingMode | None = None,
    *,
    arrivals: ArrivalSpec | None = None,
    requests: Sequence[SimRequest] | None = None,
    seed: int = 0,
    behaviour: ClientBehaviour = ClientBehaviour(),
    profiles: Mapping[str, ComputeProfile] | None = None,
    network: Network | None = None,
    concurrency: int | None = None,
    token_events: bool = True,
    plan: Plan | None = None,
    placement_options: PlacementOptions | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> ScenarioResult:
    """Plan `algorithm` on `topology`, then simulate `requests` (or ones drawn from `arrivals`, default: 100 Poisson
    requests at the workload's rate) with `routing` (default: petals routing for petals, shortest otherwise).

    `seed` fixes both the arrivals and the planner's random choices (Petals' join order), so a run is repeatable;
    `placement_options` (e.g. the MILP time limit) default to PlacementOptions(seed=seed).
    """
    topology = with_measurements(topology, profiles, network)
    if plan is None:
        plan = make_plan(topology, algorithm, routing, concurrency=concurrency,  # type: ignore[arg-type]
                         options=placement_options or PlacementOptions(seed=seed))
    mode: RoutingMode = routing or plan.routing  # type: ignore[assignment]
    if requests is None:
        requests = generate(arrivals or default_arrivals(topology), [c.name for c in topology.clients], seed)
    servers = build_servers(topology, plan)
    router = PlannerRouter.build(topology.perf, topology.model.num_blocks,
                                 [(s.server_id, plan.placement[s.server_id], s.slots) for s in servers], mode)
    sim = run_simulation(servers, router.router.perf, router, requests, behaviour, token_events, on_progress)
    summary = {
        "algorithm": plan.algorithm,
        "routing": mode,
        "concurrency_planned": plan.concurrency,
        "solve_s": plan.solve_s,
        "servers_used": len(servers),
        "wait_mode": behaviour.wait_mode,
        "seed": seed,
        "full_route_searches": router.full_searches,
        "predicted": {"per_token_s": plan.per_token_s, "ttft_s": plan.ttft_s, "decode_s": plan.decode_s,
                      "wait_s": plan.wait_s},
        "sim_wall_s": sim.wall_s,
        **sim.summary,
    }
    return ScenarioResult(plan, sim, summary)
