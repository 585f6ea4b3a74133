"""`swarmlm plan --topology FILE --algorithm petals|cg-bprr|milp [--json]`: place blocks, route clients, predict."""
from __future__ import annotations

import argparse
import json
import sys

from swarmlm.errors import PlanningError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="plan block placement and routes for a topology file",
                       description=__doc__)
    p.add_argument("--topology", required=True, metavar="FILE", help="topology file (.json, .yaml); see docs/TOPOLOGY_FORMAT.md")
    p.add_argument("--algorithm", choices=["petals", "cg-bprr", "milp"], default="cg-bprr",
                   help="placement: Petals' greedy baseline, CG-BPRR (proven bound) or the exact MILP")
    p.add_argument("--routing", choices=["shortest", "waiting-aware", "petals"], default=None,
                   help="default: petals routing for --algorithm petals, shortest path otherwise")
    p.add_argument("--concurrency", type=int, default=None, metavar="R", help="override the workload's R")
    p.add_argument("--seed", type=int, default=0, help="petals: server join order")
    p.add_argument("--time-limit", type=float, default=30.0, metavar="S", help="milp: solver time limit (s)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    from swarmlm.planner.placement import PlacementOptions
    from swarmlm.planner.plan import make_plan
    from swarmlm.planner.topology import load_topology

    topology = load_topology(args.topology)
    for warning in topology.warnings:
        print(f"swarmlm plan: warning: {warning}", file=sys.stderr)
    if args.concurrency is not None and args.concurrency < 1:
        raise PlanningError(f"--concurrency must be >= 1, got {args.concurrency}")
    plan = make_plan(topology, args.algorithm, args.routing, concurrency=args.concurrency,
                     options=PlacementOptions(seed=args.seed, time_limit_s=args.time_limit))
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
        return 0
    _print_table(plan)
    return 0


def _print_table(plan) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    placement = Table(title=f"Placement ({plan.algorithm}, R={plan.concurrency})")
    placement.add_column("server")
    placement.add_column("blocks [start, end)")
    placement.add_column("count", justify="right")
    for name, rng in sorted(plan.placement.items(), key=lambda kv: (kv[1], kv[0])):
        placement.add_row(name, str(rng), str(rng.length))
    console.print(placement)
    routes = Table(title=f"Routes ({plan.routing})")
    routes.add_column("client")
    routes.add_column("route")
    for client, spans in plan.routes.items():
        routes.add_row(client, " -> ".join(f"{s.server_id}[{s.start}:{s.end})" for s in spans))
    console.print(routes)
    summary = Table(title="Prediction")
    summary.add_column("metric")
    summary.add_column("value", justify="right")
    summary.add_row("per-token time (s)", f"{plan.per_token_s:.4f}")
    summary.add_row("time to first token (s)", f"{plan.ttft_s:.4f}")
    summary.add_row("decode step (s)", f"{plan.decode_s:.4f}")
    summary.add_row("wait for cache (s)", f"{plan.wait_s:.4f}")
    summary.add_row("solver time (s)", f"{plan.solve_s:.4f}")
    if plan.gap is not None:
        summary.add_row("optimality gap", f"{plan.gap:.2%}")
    if plan.bound_s is not None:
        summary.add_row("Theorem-2 bound, decode (s)", f"{plan.bound_s:.4f}")
    console.print(summary)
