"""Planner benchmark: predicted per-token time and TTFT of CG-BPRR vs Petals (vs MILP where it solves).

    .venv/bin/python benchmarks/planner_bench.py            # everything (~2-4 minutes, MILP time limits dominate)
    .venv/bin/python benchmarks/planner_bench.py --quick    # fewer seeds and MILP only on the smallest case

Settings follow the BPRR paper (arXiv 2512.21884) and its simulator: BLOOM-176B in NF4 (L = 70 blocks,
d_model = 14336, s_m = 1.32 GB), A100 (79.1 GB) and MIG 1g.10gb (9.5 GB) servers with the fitted per-block
times, 20 input tokens, 64/128 output tokens. Predictions come from the shared PerfModel (swarmlm.perf): R
concurrent requests routed at t = 0 (see swarmlm/planner/plan.py); the discrete-event simulator gives times
under Poisson arrivals.
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from pathlib import Path

import networkx as nx
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import dijkstra

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarmlm.errors import PlanningError  # noqa: E402
from swarmlm.machine import machine_line  # noqa: E402
from swarmlm.perf.model import ClientSpec, ComputeProfile, ModelSpec, Network, ServerSpec, Workload  # noqa: E402
from swarmlm.planner.placement import PlacementOptions  # noqa: E402
from swarmlm.planner.plan import Plan, make_plan, plan_concurrency  # noqa: E402
from swarmlm.planner.topology import Topology  # noqa: E402

D_MODEL = 14336
A100 = ComputeProfile(prefill_a_s=0.0743e-3, prefill_b_s=32.99e-3, decode_s=3.22e-3)
MIG = ComputeProfile(prefill_a_s=0.1041e-3, prefill_b_s=206.35e-3, decode_s=16.25e-3)
A100_BYTES, MIG_BYTES = 79.138e9, 9.5e9  # the authors' simulator's GPU capacities


def bloom(l_in: int, l_out: int) -> ModelSpec:
    tokens = l_in + l_out  # caches sized for the workload's longest session (l_in_max + l_max)
    return ModelSpec(num_blocks=70, block_bytes=1.32e9, cache_bytes_per_session_block=2 * D_MODEL * tokens * 2.0,
                     hidden_bytes_per_token=2.0 * D_MODEL, session_tokens=tokens)


def clustered(n_a100: int, n_mig: int, n_cpu_clients: int, l_out: int, rate: float) -> Topology:
    """Three clusters: CPU clients; A100 servers (+1 client); MIG servers (+1 client). 5 ms / 1 Gbit/s inside
    a cluster, 100 ms / 100 Mbit/s between."""
    servers = [ServerSpec(f"a100-{i}", A100_BYTES, A100, "a100") for i in range(n_a100)]
    servers += [ServerSpec(f"mig-{i}", MIG_BYTES, MIG, "mig") for i in range(n_mig)]
    clients = [ClientSpec(f"cpu-{i}", "cpu") for i in range(n_cpu_clients)]
    clients += [ClientSpec("client-a100", "a100"), ClientSpec("client-mig", "mig")]
    cluster_of = {n.name: n.cluster for n in [*servers, *clients]}
    net = Network.from_clusters(cluster_of, 0.005, 0.100, 1e9, 1e8)
    return Topology(bloom(20, l_out), tuple(servers), tuple(clients), net, Workload(20, l_out, arrival_rate=rate))


def geo(n_nodes: int, seed: int, l_out: int, rate: float, n_clients: int | None = None,
        frac_a100: float = 0.2) -> Topology:
    """Random geometric 'ISP': nodes in a 4000 km square linked within a radius; RTT = 2 x shortest-path fibre
    delay (200,000 km/s) + 2 ms access. One server per node (20% A100-class); clients sit at random nodes."""
    rng = random.Random(seed)
    radius = 1.6 * math.sqrt(math.log(n_nodes) / (math.pi * n_nodes))
    for attempt in range(100):
        g = nx.random_geometric_graph(n_nodes, radius, seed=seed * 1000 + attempt)
        if nx.is_connected(g):
            break
    else:
        raise RuntimeError("could not draw a connected geometric graph")
    pos = nx.get_node_attributes(g, "pos")
    edges = list(g.edges)
    delay = [math.dist(pos[a], pos[b]) * 4000.0 / 200_000.0 for a, b in edges]
    adjacency = csr_matrix((delay, ([a for a, _ in edges], [b for _, b in edges])), shape=(n_nodes, n_nodes))
    kinds = [A100 if rng.random() < frac_a100 else MIG for _ in range(n_nodes)]
    servers = [ServerSpec(f"s{j}", A100_BYTES if k is A100 else MIG_BYTES, k) for j, k in enumerate(kinds)]
    n_clients = n_clients or max(2, n_nodes // 10)
    homes = [rng.randrange(n_nodes) for _ in range(n_clients)]
    clients = [ClientSpec(f"c{i}") for i in range(n_clients)]
    path_delay = dijkstra(adjacency, directed=False, indices=homes)  # [client, node] one-way seconds
    net = Network()
    for i, client in enumerate(clients):
        for j in range(n_nodes):
            net.set_link(client.name, f"s{j}", 2 * float(path_delay[i, j]) + 0.002, 1e9)
    return Topology(bloom(20, l_out), tuple(servers), tuple(clients), net, Workload(20, l_out, arrival_rate=rate))


def _plan(topology: Topology, algorithm: str, R: int, routing: str | None = None, seed: int = 0,
          time_limit_s: float = 60.0) -> Plan | None:
    try:
        return make_plan(topology, algorithm, routing, concurrency=R,
                         options=PlacementOptions(seed=seed, time_limit_s=time_limit_s))
    except PlanningError as exc:
        print(f"  ({algorithm}: {exc})", file=sys.stderr)
        return None


def _petals(topology: Topology, R: int, seeds: int, routing: str | None = None) -> tuple[float, float, float]:
    """Petals depends on the join order: mean per-token, TTFT and solve time over `seeds` orders."""
    plans = [p for s in range(seeds) if (p := _plan(topology, "petals", R, routing, seed=s)) is not None]
    if not plans:
        return math.nan, math.nan, math.nan
    return (statistics.mean(p.per_token_s for p in plans), statistics.mean(p.ttft_s for p in plans),
            statistics.mean(p.solve_s for p in plans))


def _row(name: str, topology: Topology, seeds: int, milp_limit_s: float | None) -> str:
    R = plan_concurrency(topology)
    cg = _plan(topology, "cg-bprr", R)
    ws = _plan(topology, "cg-bprr", R, "waiting-aware")
    pt, pf, ps = _petals(topology, R, seeds)
    rt, rf, _ = _petals(topology, R, seeds, "shortest")  # Petals' placement with BPRR routing ("RR only")
    milp = _plan(topology, "milp", R, time_limit_s=milp_limit_s) if milp_limit_s else None
    cells = [name, str(len(topology.servers)), str(len(topology.clients)), str(R)]
    cells += [f"{pt * 1e3:.1f} / {pf:.2f}", f"{rt * 1e3:.1f} / {rf:.2f}"]
    cells += [f"{cg.per_token_s * 1e3:.1f} / {cg.ttft_s:.2f}" if cg else "infeasible"]
    cells += [f"{ws.per_token_s * 1e3:.1f} / {ws.ttft_s:.2f}" if ws else "infeasible"]
    cells += [f"{milp.per_token_s * 1e3:.1f} / {milp.ttft_s:.2f} (gap {milp.gap:.0%}, {milp.solve_s:.0f} s)"
              if milp else ("-" if not milp_limit_s else "no solution")]
    cells += [f"{(1 - cg.per_token_s / pt) * 100:.0f}%" if cg and pt == pt else "-"]
    cells += [f"{cg.solve_s * 1e3:.0f} / {ps * 1e3:.0f}" if cg else "-"]
    return "| " + " | ".join(cells) + " |"


HEADER = ("| setting | servers | clients | R | Petals ms/tok / TTFT s | Petals place + BPRR route | CG-BPRR | "
          "CG-BPRR + WS-RR | MILP | CG vs Petals | plan ms (CG / Petals) |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")


def scale_test(n_servers: int = 1000, n_clients: int = 100, rate: float = 2.0) -> str:
    """Whole planning pipeline -- R from the arrival rate, CG-BPRR placement, route every request -- timed."""
    topology = geo(n_servers, seed=7, l_out=128, rate=rate, n_clients=n_clients)
    out = []
    for routing in ("shortest", "waiting-aware"):
        started, cpu = time.perf_counter(), time.process_time()
        plan = make_plan(topology, "cg-bprr", routing)  # includes choosing R (a second, R = 1, CG-BPRR run)
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
        out.append(f"| cg-bprr + {routing} | {n_servers} | {n_clients} | {plan.concurrency} | {wall:.2f} s | "
                   f"{cpu:.2f} s | {plan.per_token_s * 1e3:.1f} ms | {plan.ttft_s:.2f} s |")
    return (f"| planner (R from arrival rate {rate}/s) | servers | clients | R | wall time | CPU time | per-token | TTFT |\n"
            "|---|---|---|---|---|---|---|---|\n" + "\n".join(out))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    print("machine:", machine_line(), flush=True)  # where the figures below come from
    seeds = 5 if args.quick else 20
    print("## Clustered (A100 cluster, MIG cluster, CPU clients; 5 ms / 100 ms RTT)\n")
    print("Cells: average per-token time (ms) / time to first token (s), predicted for R concurrent requests.\n")
    print(HEADER)
    for n_a100, n_mig in ((2, 7), (4, 14), (8, 28)):
        for l_out, rate in ((64, 0.1), (128, 0.1), (128, 0.5)):
            small = n_a100 == 2 and rate == 0.1 and (l_out == 64 or not args.quick)
            topo = clustered(n_a100, n_mig, 2, l_out, rate)
            print(_row(f"{n_a100} A100 + {n_mig} MIG, l_out={l_out}, {rate}/s", topo, seeds,
                       60.0 if small else None), flush=True)
    print("\n## Random geographic topologies (20% A100-class, RTT = 2 x path delay)\n")
    print(HEADER)
    for n in (20, 48, 100, 150):
        for rate in (0.1, 0.5):
            topo = geo(n, seed=n, l_out=128, rate=rate)
            limit = 60.0 if (n == 20 and rate == 0.1 and not args.quick) else None
            print(_row(f"geo n={n}, l_out=128, {rate}/s", topo, seeds, limit), flush=True)
    print("\n## Scale: 1,000 servers, 100 clients\n")
    print(scale_test())
    return 0


if __name__ == "__main__":
    sys.exit(main())
