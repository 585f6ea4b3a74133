"""Small hand-made topologies and an exhaustive BPRR solver for the planner tests."""
from __future__ import annotations

import itertools
import math
import random

from swarmlm.config import MESSAGE_OVERHEAD_S
from swarmlm.perf.model import ClientSpec, ComputeProfile, ModelSpec, Network, ServerSpec, Workload
from swarmlm.planner.placement import request_clients
from swarmlm.planner.topology import Topology
from swarmlm.types import BlockRange, Span


def make_topology(servers: list[tuple[str, float, float, float]], rtt: dict[tuple[str, str], float],
                  clients: list[str], num_blocks: int, block_bytes: float = 1.0, cache_bytes: float = 0.5,
                  l_in: int = 10, l_out: int = 8, concurrency: int = 2,
                  message_overhead_s: float = MESSAGE_OVERHEAD_S) -> Topology:
    """servers: (name, memory_bytes, prefill_b_s, decode_s); prefill is b + 0.001 * l_in per block."""
    specs = tuple(ServerSpec(n, mem, ComputeProfile(0.001 if pre else 0.0, pre, dec)) for n, mem, pre, dec in servers)
    net = Network()
    for (a, b), v in rtt.items():
        net.set_link(a, b, v)
    return Topology(ModelSpec(num_blocks, block_bytes, cache_bytes), specs, tuple(ClientSpec(c) for c in clients),
                    net, Workload(l_in, l_out, concurrency=concurrency), message_overhead_s=message_overhead_s)


def random_topology(rng: random.Random, n_servers: int, n_clients: int, num_blocks: int, concurrency: int,
                    memories: tuple[float, ...] = (1.5, 2.5, 3.5), prefill: bool = True) -> Topology:
    servers = [(f"s{j}", rng.choice(memories), rng.uniform(0.005, 0.05) if prefill else 0.0,
                rng.uniform(0.001, 0.02)) for j in range(n_servers)]
    clients = [f"c{i}" for i in range(n_clients)]
    rtt = {(c, s[0]): rng.uniform(0.005, 0.2) for c in clients for s in servers}
    return make_topology(servers, rtt, clients, num_blocks, concurrency=concurrency)


def _chains(ranges: dict[str, BlockRange], num_blocks: int) -> list[list[Span]]:
    out: list[list[Span]] = []

    def extend(pos: int, acc: list[Span]) -> None:
        if pos == num_blocks:
            out.append(list(acc))
            return
        for sid, r in ranges.items():
            if r.start <= pos < r.end:
                acc.append(Span(sid, pos, r.end))
                extend(r.end, acc)
                acc.pop()
    extend(0, [])
    return out


def exhaustive_optimum(topology: Topology, concurrency: int) -> float:
    """Minimum total request time of R requests over every placement and every routing that fits in memory."""
    model, perf, wl = topology.model, topology.perf, topology.workload
    L = model.num_blocks
    options_per_server = []
    for s in topology.servers:
        opts: list[BlockRange | None] = [None]
        opts += [BlockRange(a, e) for a in range(L) for e in range(a + 1, L + 1)
                 if model.block_bytes * (e - a) <= s.memory_bytes + 1e-9]
        options_per_server.append(opts)
    names = [s.name for s in topology.servers]
    memory = {s.name: s.memory_bytes for s in topology.servers}
    clients = request_clients(topology.clients, concurrency)
    best = math.inf
    for combo in itertools.product(*options_per_server):
        ranges = {n: r for n, r in zip(names, combo) if r is not None}
        chains = _chains(ranges, L)
        if not chains:
            continue
        cost = {c: [perf.request_time_s(c, ch, wl.input_tokens, wl.output_tokens) for ch in chains] for c in set(clients)}
        for pick in itertools.product(range(len(chains)), repeat=concurrency):
            total = sum(cost[c][p] for c, p in zip(clients, pick))
            if total >= best:
                continue
            used = {n: model.block_bytes * r.length for n, r in ranges.items()}
            for p in pick:
                for span in chains[p]:
                    used[span.server_id] += model.cache_bytes_per_session_block * span.length
            if all(used[n] <= memory[n] + 1e-9 for n in used):
                best = total
    return best
