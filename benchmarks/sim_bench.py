"""The paper's comparison in simulation, and the simulator's scale benchmark.

    python benchmarks/sim_bench.py paper [--requests 200] [--seeds 0 1 2] [--out out/sim_bench]
    python benchmarks/sim_bench.py scale [--servers 1000] [--requests 10000] [--rate 20] [--a100 20]
                                         [--routing waiting-aware|shortest|petals] [--wait backoff|queue]
                                         [--concurrency R] [--coarse-decode]

paper: CG-BPRR + waiting-aware routing against Petals (its placement and its routing) on the clustered setting
and on random geographic topologies of 20, 50 and 150 nodes, Poisson arrivals at 0.1 and 0.5 requests/s,
BLOOM-176B, 20 input tokens and 64 or 128 output tokens. Each cell is the mean over seeds of the mean over
requests (the same arrivals for both algorithms in a seed).
scale: 1,000 servers in 10 clusters (--a100 of each 100 A100-class, the rest MIG-class), 10,000 requests of
20 in / 128 out; planner and simulation timed apart, wall and CPU.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarmlm.machine import machine_info  # noqa: E402
from swarmlm.planner.topology import parse_topology  # noqa: E402
from swarmlm.sim.arrivals import ArrivalSpec  # noqa: E402
from swarmlm.sim.generators import PAPER_CLUSTERS, ClusterSpec, clustered_topology, random_geo_topology  # noqa: E402
from swarmlm.sim.scenario import simulate_scenario  # noqa: E402
from swarmlm.sim.session import ClientBehaviour  # noqa: E402

CONTENDERS = (("cg-bprr", "waiting-aware"), ("petals", "petals"))
KEYS = ("mean_per_token_s", "mean_ttft_s", "mean_wait_s", "mean_decode_per_token_s", "p90_per_token_s", "timed_out")


def settings(rate: float, l_out: int, seed: int) -> list[tuple[str, dict]]:
    """(name, topology document) of every network setting for one rate, output length and seed.

    geo-N: the authors' simulator's scattered setting, 9 servers (20 % A100-class) and 1 client on random nodes
    of an N-node graph. geo-N-dense: 40 % of the nodes host a server, one client per 25 nodes.
    """
    out = [("clustered", clustered_topology(PAPER_CLUSTERS, 20, l_out, rate))]
    for n in (20, 50, 150):
        common = dict(input_tokens=20, output_tokens=l_out, arrival_rate=rate)
        out.append((f"geo-{n}", random_geo_topology(n, seed=1000 + seed, n_servers=9, n_clients=1, **common)))
        out.append((f"geo-{n}-dense", random_geo_topology(n, seed=1000 + seed, n_clients=max(1, round(n / 25)),
                                                          **common)))
    return out


def run_paper(requests: int, seeds: list[int], out: Path) -> list[dict]:
    rows = []
    for l_out in (64, 128):
        for rate in (0.1, 0.5):
            cells: dict[tuple[str, str], list[dict]] = {}
            for seed in seeds:
                for name, doc in settings(rate, l_out, seed):
                    topo = parse_topology(doc)
                    spec = ArrivalSpec("poisson", rate, count=requests, input_tokens=20, output_tokens=l_out)
                    for algorithm, routing in CONTENDERS:
                        res = simulate_scenario(topo, algorithm, routing, arrivals=spec, seed=seed)
                        cells.setdefault((name, algorithm), []).append(res.summary)
            for (name, algorithm), runs in cells.items():
                row = {"setting": name, "l_out": l_out, "rate": rate, "algorithm": algorithm, "seeds": len(runs),
                       "servers": runs[0]["servers_used"], "R": statistics.mean(r["concurrency_planned"] for r in runs),
                       "solve_s": statistics.mean(r["solve_s"] for r in runs)}
                for k in KEYS:
                    row[k] = statistics.mean(r[k] for r in runs)
                rows.append(row)
                print(json.dumps(row), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "paper.json").write_text(json.dumps({"machine": machine_info(), "rows": rows}, indent=1))
    print(paper_table(rows))
    return rows


def paper_table(rows: list[dict]) -> str:
    by = {(r["setting"], r["l_out"], r["rate"], r["algorithm"]): r for r in rows}
    lines = ["| setting | l_out | rate (req/s) | per-token s: CG-BPRR+WS / Petals (reduction) "
             "| TTFT s: CG-BPRR+WS / Petals (reduction) | decode step s: CG / Petals | wait s: CG / Petals |",
             "|---|---|---|---|---|---|---|"]
    for (setting, l_out, rate, alg), cg in sorted(by.items()):
        if alg != "cg-bprr":
            continue
        pe = by[(setting, l_out, rate, "petals")]

        def red(key: str) -> str:
            return f"{cg[key]:.3f} / {pe[key]:.3f} ({1 - cg[key] / pe[key]:+.0%})".replace("+", "-", 1) \
                if cg[key] <= pe[key] else f"{cg[key]:.3f} / {pe[key]:.3f} (+{cg[key] / pe[key] - 1:.0%})"
        lines.append(f"| {setting} ({cg['servers']} servers) | {l_out} | {rate} | {red('mean_per_token_s')} | "
                     f"{red('mean_ttft_s')} | "
                     f"{cg['mean_decode_per_token_s']:.3f} / {pe['mean_decode_per_token_s']:.3f} "
                     f"| {cg['mean_wait_s']:.2f} / {pe['mean_wait_s']:.2f} |")
    return "\n".join(lines)


def run_scale(servers: int, requests: int, rate: float, coarse: bool, routing: str,
              concurrency: int | None = None, a100: int = 20, wait: str = "backoff") -> dict:
    clusters = servers // 100
    doc = clustered_topology([ClusterSpec(f"c{i}", a100=a100, mig=100 - a100, clients=1) for i in range(clusters)],
                             20, 128, rate)
    topo = parse_topology(doc)
    spec = ArrivalSpec("poisson", rate, count=requests, input_tokens=20, output_tokens=128)
    t0, cpu0 = time.perf_counter(), time.process_time()
    res = simulate_scenario(topo, "cg-bprr", routing, arrivals=spec, seed=0, token_events=not coarse,
                            concurrency=concurrency, behaviour=ClientBehaviour(wait_mode=wait))
    total, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    s = res.summary
    row = {"servers": len(topo.servers), "a100": a100 * clusters, "requests": s["requests"],
           "completed": s["completed"], "rate": rate,
           "routing": routing, "wait": wait, "token_events": not coarse, "R": s["concurrency_planned"],
           "events": s["events"],
           "planner_s": round(s["solve_s"], 2), "simulation_s": round(s["sim_wall_s"], 2),
           "total_s": round(total, 2), "total_cpu_s": round(cpu, 2), "full_route_searches": s["full_route_searches"],
           "mean_per_token_s": s["mean_per_token_s"], "mean_ttft_s": s["mean_ttft_s"], "mean_wait_s": s["mean_wait_s"],
           "p99_wait_s": s["p99_wait_s"], "timed_out": s["timed_out"],
           "peak_concurrent_sessions": s["peak_concurrent_sessions"]}
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=["paper", "scale"])
    ap.add_argument("--requests", type=int, default=None, help="paper: per run (200); scale: total (10000)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--servers", type=int, default=1000, help="scale: servers (multiple of 100)")
    ap.add_argument("--rate", type=float, default=20.0, help="scale: arrival rate, requests/s")
    ap.add_argument("--routing", default="waiting-aware", help="scale: routing")
    ap.add_argument("--concurrency", type=int, default=None, help="scale: plan for this R instead of the rate's")
    ap.add_argument("--a100", type=int, default=20, help="scale: A100-class servers per 100 (the rest MIG)")
    ap.add_argument("--wait", choices=["backoff", "queue"], default="backoff", help="scale: client waiting")
    ap.add_argument("--coarse-decode", action="store_true", help="scale: one event per decode, not per token")
    ap.add_argument("--out", default="out/sim_bench")
    args = ap.parse_args()
    if args.part == "paper":
        run_paper(args.requests or 200, args.seeds, Path(args.out))
    else:
        run_scale(args.servers, args.requests or 10000, args.rate, args.coarse_decode, args.routing, args.concurrency,
                  args.a100, args.wait)
    return 0


if __name__ == "__main__":
    sys.exit(main())
