"""`swarmlm simulate --topology FILE --algorithm petals|cg-bprr|milp [--routing ...] [--requests N | --duration S]
[--seed S] [--json] [--out DIR]`: plan with the planner, then simulate requests through the placement."""
from __future__ import annotations

import argparse
import sys


PROGRESS_MIN_REQUESTS = 500  # show a progress bar from this many requests on (short runs finish instantly)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="simulate a deployment: placement, routing, waiting, latencies",
                       description=__doc__)
    p.add_argument("--topology", required=True, metavar="FILE", help="topology file (.json, .yaml); its workload "
                   "gives arrival_rate and token counts")
    p.add_argument("--algorithm", choices=["petals", "cg-bprr", "milp"], default="cg-bprr",
                   help="placement: Petals' greedy baseline, CG-BPRR (proven bound) or the exact MILP")
    p.add_argument("--routing", choices=["shortest", "waiting-aware", "petals"], default=None,
                   help="default: petals routing for --algorithm petals, shortest path otherwise")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--requests", type=int, default=None, metavar="N",
                      help="Poisson requests to simulate (default 100)")
    size.add_argument("--duration", type=float, default=None, metavar="S", help="simulate arrivals for S seconds")
    size.add_argument("--trace", default=None, metavar="FILE",
                      help="CSV/JSONL of arrival_s,input_tokens,output_tokens[,client] instead of Poisson arrivals")
    p.add_argument("--rate", type=float, default=None, metavar="REQ_PER_S", help="override workload.arrival_rate")
    p.add_argument("--seed", type=int, default=0, help="arrivals and Petals' join order")
    p.add_argument("--time-limit", type=float, default=30.0, metavar="S", help="milp: solver time limit (s)")
    p.add_argument("--concurrency", type=int, default=None, metavar="R", help="override the planned R")
    p.add_argument("--wait", choices=["backoff", "queue"], default="backoff",
                   help="refused clients retry with exponential backoff (like the real client) or queue at the server")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S", help="client gives up after waiting S s")
    p.add_argument("--coarse-decode", action="store_true",
                   help="one event per decode instead of per token (same results, faster on huge runs)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--out", default=None, metavar="DIR", help="write requests.csv, servers.csv, summary.json, plots")


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from swarmlm.planner.placement import PlacementOptions
    from swarmlm.planner.topology import load_topology
    from swarmlm.sim.arrivals import ArrivalSpec
    from swarmlm.sim.metrics import to_json
    from swarmlm.sim.scenario import default_arrivals, simulate_scenario
    from swarmlm.sim.session import ClientBehaviour

    if args.requests is not None and args.requests < 1:
        raise ValueError(f"--requests must be >= 1, got {args.requests}")
    topology = load_topology(args.topology)
    for warning in topology.warnings:
        print(f"swarmlm simulate: warning: {warning}", file=sys.stderr)
    if args.rate is not None:
        topology = dataclasses.replace(topology, workload=dataclasses.replace(topology.workload,
                                                                              arrival_rate=args.rate))
    if args.trace:
        wl = topology.workload
        arrivals = ArrivalSpec("trace", trace_path=args.trace, input_tokens=wl.input_tokens,
                               output_tokens=wl.output_tokens)
    else:
        arrivals = default_arrivals(topology, args.requests, args.duration)
    behaviour = ClientBehaviour(wait_mode=args.wait, timeout_s=args.timeout)
    with _progress(enabled=not args.json) as on_progress:
        result = simulate_scenario(topology, args.algorithm, args.routing, arrivals=arrivals, seed=args.seed,
                                   behaviour=behaviour, concurrency=args.concurrency,
                                   token_events=not args.coarse_decode, on_progress=on_progress,
                                   placement_options=PlacementOptions(seed=args.seed,
                                                                      time_limit_s=args.time_limit))
    if args.out:
        _write_out(args.out, result)
    if args.json:
        summary = dict(result.summary)
        servers = summary.pop("servers")  # the long per-server list goes last
        print(to_json({**summary, "servers": servers}))
    else:
        _print_table(result.summary)
    return 0


class _progress:
    """A rich progress bar on stderr for long runs; yields the callback (or None when disabled)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.bar = None
        self.task = None

    def __enter__(self):
        if not self.enabled:
            return None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        self.bar = Progress("simulating", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=Console(stderr=True), transient=True)
        self.bar.start()

        def update(done: int, total: int) -> None:
            if total < PROGRESS_MIN_REQUESTS:
                return
            if self.task is None:
                self.task = self.bar.add_task("sim", total=total)
            self.bar.update(self.task, completed=done)
        return update

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()


def _write_out(out: str, result) -> None:
    from swarmlm.sim.metrics import write_outputs
    from swarmlm.sim.plots import plot_run

    title = f"{result.summary['algorithm']} + {result.summary['routing']}"
    paths = write_outputs(out, result.sim.records, result.summary)
    paths += plot_run(result.sim.records, result.summary, out, title)
    print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)


def _print_table(s: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"Simulation: {s['algorithm']} + {s['routing']} routing, {s['requests']} requests "
                    f"(R planned = {s['concurrency_planned']})")
    t.add_column("metric")
    for col in ("mean", "p50", "p90", "p99"):
        t.add_column(col, justify="right")

    def fmt(x) -> str:
        return "-" if x is None or x != x else f"{x:.4f}"
    for label, key in (("per-token time (s)", "per_token_s"), ("time to first token (s)", "ttft_s"),
                       ("wait for cache slots (s)", "wait_s")):
        t.add_row(label, *(fmt(s.get(f"{q}_{key}")) for q in ("mean", "p50", "p90", "p99")))
    console = Console()
    console.print(t)
    console.print(f"completed {s['completed']}, timed out {s['timed_out']}, throughput "
                  f"{s['throughput_req_per_s']:.3f} req/s ({s['throughput_tokens_per_s']:.1f} tokens/s), "
                  f"mean decode step {fmt(s['mean_decode_per_token_s'])} s, makespan {s['makespan_s']:.1f} s; "
                  f"planner {s['solve_s']:.2f} s, simulation {s['sim_wall_s']:.2f} s ({s['events']} events)")
    busiest = sorted(s["servers"], key=lambda r: -r["mean_cache_occupancy"])[:10]
    st = Table(title="busiest servers (by mean cache occupancy)")
    for col in ("server", "blocks", "slots", "sessions", "busy", "mean occ.", "peak occ."):
        st.add_column(col, justify="right")
    for r in busiest:
        st.add_row(r["server_id"], r["blocks"], str(r["slots"]), str(r["sessions"]), f"{r['busy_fraction']:.2f}",
                   f"{r['mean_cache_occupancy']:.2f}", f"{r['peak_cache_occupancy']:.2f}")
    console.print(st)
