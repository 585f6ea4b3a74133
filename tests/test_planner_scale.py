"""CG-BPRR with routing on 1,000 servers and 100 clients: a complete plan. How long planning takes is measured by
`benchmarks/planner_bench.py` (its scale test: wall and CPU time); a test on a busy machine does not time it."""
from __future__ import annotations

import random

from swarmlm.perf.model import ClientSpec, ComputeProfile, ModelSpec, Network, ServerSpec, Workload
from swarmlm.planner.plan import make_plan
from swarmlm.planner.topology import Topology


def test_cg_bprr_plans_1000_servers_and_100_clients():
    rng = random.Random(0)
    a100 = ComputeProfile(0.0743e-3, 32.99e-3, 3.22e-3)
    mig = ComputeProfile(0.1041e-3, 206.35e-3, 16.25e-3)
    servers = tuple(ServerSpec(f"s{j}", 79.1e9 if rng.random() < 0.2 else 9.5e9,
                               a100 if j % 5 == 0 else mig, f"k{j % 20}") for j in range(1000))
    clients = tuple(ClientSpec(f"c{i}", f"k{rng.randrange(20)}") for i in range(100))
    net = Network.from_clusters({n.name: n.cluster for n in [*servers, *clients]}, 0.005, 0.1)
    for c in clients:  # a few measured RTTs on top of the cluster rule
        net.set_link(c.name, f"s{rng.randrange(1000)}", 0.002)
    model = ModelSpec(70, 1.32e9, 2 * 14336 * 148 * 2.0, session_tokens=148)
    topology = Topology(model, servers, clients, net, Workload(20, 128, arrival_rate=2.0))
    plan = make_plan(topology, "cg-bprr", "waiting-aware")
    assert len(plan.routes) == 100 and plan.concurrency >= 1
    covered = set()
    for r in plan.placement.values():
        covered.update(range(r.start, r.end))
    assert covered == set(range(70))
