"""Topologies for the paper's settings, written in the planner's topology format (a dict; `write_topology` saves it).

- `clustered_topology`: clusters of clients and servers; RTT/bandwidth depend only on same/different cluster
  (the paper: CPU-client cluster, A100 cluster, MIG cluster; 5 ms and 1 Gbit/s inside, 100 ms and 100 Mbit/s
  between).
- `random_geo_topology`: n nodes scattered on a plane, a connected random graph whose link delay is distance
  over the speed of light in fibre; RTT = 2 x shortest-path delay (the paper's rule for ISP topologies).
- `graphml_topology`: the same from a Topology-Zoo-style GraphML file (link delays, or node coordinates).

The hardware and model numbers are the paper's fits (BLOOM-176B in NF4 on an A100 80 GB and a MIG 1g.10gb).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import networkx as nx
import numpy as np

FIBRE_S_PER_KM = 5e-6  # light in fibre: ~200,000 km/s


@dataclass(frozen=True)
class ServerClass:
    name: str
    memory_bytes: float  # GPU memory for blocks and caches
    prefill_a_s: float  # seconds per block per prompt token
    prefill_b_s: float  # seconds per block per prompt
    decode_s: float  # seconds per block per generated token

    def entry(self, count: int, cluster: str | None = None, name: str | None = None) -> dict:
        e = {"name": name or self.name, "count": count, "memory_bytes": self.memory_bytes,
             "tau_prefill_s": [self.prefill_a_s, self.prefill_b_s], "tau_decode_s": self.decode_s}
        if cluster is not None:
            e["cluster"] = cluster
        return e


# the paper's fitted profiles (ms in the paper, seconds here) and usable memory (its simulator's M_j)
A100 = ServerClass("a100", 79.13e9, 0.0743e-3, 32.99e-3, 3.22e-3)
MIG = ServerClass("mig", 8.2e9, 0.1041e-3, 206.35e-3, 16.25e-3)


def bloom176b_model(session_tokens: int) -> dict:
    """BLOOM-176B in NF4: 70 blocks of 2.47e9 parameters at 4.25 bits (+1 %), d_model 14336, bf16 caches."""
    d_model = 14336
    return {
        "num_blocks": 70,
        "block_bytes": 2466437120 * 4.25 / 8 * 1.01,  # ~1.32 GB, the paper's s_m
        "cache_bytes_per_session_block": 2 * d_model * session_tokens * 2,  # K and V, bf16
        "session_tokens": session_tokens,
        "hidden_bytes_per_token": d_model * 2,  # bf16 hidden state sent per token per hop
    }


def workload(input_tokens: int, output_tokens: int, arrival_rate: float) -> dict:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, "arrival_rate": arrival_rate}


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    a100: int = 0  # A100-class servers in this cluster
    mig: int = 0  # MIG-class servers
    clients: int = 0

    def __post_init__(self) -> None:
        if min(self.a100, self.mig, self.clients) < 0 or self.a100 + self.mig + self.clients == 0:
            raise ValueError(f"cluster {self.name}: counts must be >= 0 and not all zero")


# the paper's clustered setting: clients everywhere, 2 A100s in one cluster, 7 MIG slices in another
PAPER_CLUSTERS = (ClusterSpec("cpu", clients=1), ClusterSpec("gpu", a100=2, clients=1),
                  ClusterSpec("mig", mig=7, clients=1))


def clustered_topology(clusters: Sequence[ClusterSpec] = PAPER_CLUSTERS, input_tokens: int = 20,
                       output_tokens: int = 128, arrival_rate: float = 0.1, intra_rtt_s: float = 0.005,
                       inter_rtt_s: float = 0.100, intra_bandwidth_bps: float = 1e9,
                       inter_bandwidth_bps: float = 1e8) -> dict:
    servers, clients = [], []
    for c in clusters:
        if c.a100:
            servers.append(A100.entry(c.a100, c.name, f"{c.name}-a100"))
        if c.mig:
            servers.append(MIG.entry(c.mig, c.name, f"{c.name}-mig"))
        if c.clients:
            clients.append({"name": f"{c.name}-client", "count": c.clients, "cluster": c.name})
    return {
        "name": "clustered",
        "model": bloom176b_model(input_tokens + output_tokens),
        "servers": servers,
        "clients": clients,
        "clusters": {"intra_rtt_s": intra_rtt_s, "inter_rtt_s": inter_rtt_s,
                     "intra_bandwidth_bps": intra_bandwidth_bps, "inter_bandwidth_bps": inter_bandwidth_bps},
        "workload": workload(input_tokens, output_tokens, arrival_rate),
    }


def random_geo_graph(n_nodes: int, seed: int, area_km: float = 4000.0, extra_edge_prob: float = 0.4,
                     link_bandwidth_bps: float = 1e9) -> nx.Graph:
    """A connected graph: the Euclidean minimum spanning tree plus Waxman-style shortcuts (likelier if close).

    Edge attributes: delay_s (distance x fibre delay), bandwidth_bps.
    """
    if n_nodes < 2:
        raise ValueError(f"need at least 2 nodes, got {n_nodes}")
    rng = np.random.default_rng(seed)
    pos = rng.uniform(0, area_km, size=(n_nodes, 2))
    full = nx.Graph()
    dist = np.linalg.norm(pos[:, None, :] - pos[None, :, :], axis=-1)
    for i in range(n_nodes):
        for j in range(i + 1, n_nodes):
            full.add_edge(i, j, km=float(dist[i, j]))
    g = nx.minimum_spanning_tree(full, weight="km")  # connectivity first
    diag = area_km * math.sqrt(2)
    for i in range(n_nodes):
        for j in range(i + 1, n_nodes):
            # Waxman: P(edge) = beta * exp(-d / (alpha * diameter)); alpha = 0.15 keeps links mostly regional
            if not g.has_edge(i, j) and rng.random() < extra_edge_prob * math.exp(-dist[i, j] / (0.15 * diag)):
                g.add_edge(i, j, km=float(dist[i, j]))
    for i, (x, y) in enumerate(pos):
        g.nodes[i]["x_km"], g.nodes[i]["y_km"] = float(x), float(y)
    for _, _, d in g.edges(data=True):
        d["delay_s"] = d["km"] * FIBRE_S_PER_KM
        d["bandwidth_bps"] = link_bandwidth_bps
    return g


def graph_topology(g: nx.Graph, seed: int, n_servers: int | None = None, n_clients: int = 1,
                   a100_fraction: float = 0.2, input_tokens: int = 20, output_tokens: int = 128,
                   arrival_rate: float = 0.1, server_links: bool = True, name: str = "graph") -> dict:
    """Put clients and servers on distinct nodes (seeded), a100_fraction of servers A100-class, rest MIG.

    RTT(a, b) = 2 x shortest-path delay; bandwidth = the bottleneck link on that path. Client-server pairs are
    always written (the BPRR model relays through the client); server-server pairs too if `server_links`.
    """
    nodes = sorted(g.nodes)
    n_servers = max(1, round(0.4 * len(nodes))) if n_servers is None else n_servers
    if n_clients < 1 or n_servers < 1 or n_clients + n_servers > len(nodes):
        raise ValueError(f"{n_clients} clients + {n_servers} servers do not fit on {len(nodes)} nodes")
    if not nx.is_connected(g):
        raise ValueError("the graph is not connected: some RTTs would be infinite")
    rng = np.random.default_rng(seed)
    picked = [nodes[int(i)] for i in rng.permutation(len(nodes))[: n_clients + n_servers]]
    client_nodes, server_nodes = picked[:n_clients], picked[n_clients:]
    n_a100 = round(n_servers * a100_fraction)
    kinds = [A100] * n_a100 + [MIG] * (n_servers - n_a100)
    kinds = [kinds[int(i)] for i in rng.permutation(n_servers)]
    server_names = {node: f"{kind.name}-{node}" for node, kind in zip(server_nodes, kinds)}
    client_names = {node: f"client-{node}" for node in client_nodes}
    rtt: dict[str, dict[str, float]] = {}
    bw: dict[str, dict[str, float]] = {}
    sources = client_nodes + (server_nodes if server_links else [])
    done: set = set()
    for a in sources:
        delay, paths = nx.single_source_dijkstra(g, a, weight="delay_s")
        done.add(a)
        for b in server_nodes:
            if b == a or b in done:
                continue
            name_a = client_names.get(a) or server_names[a]
            rtt.setdefault(name_a, {})[server_names[b]] = 2 * delay[b]
            path = paths[b]
            bw.setdefault(name_a, {})[server_names[b]] = min(g.edges[u, v].get("bandwidth_bps", math.inf)
                                                            for u, v in zip(path, path[1:]))
    servers = [kind.entry(1, name=server_names[node]) for node, kind in zip(server_nodes, kinds)]
    for s in servers:
        del s["count"]  # one named server per node
    return {
        "name": name,
        "model": bloom176b_model(input_tokens + output_tokens),
        "servers": servers,
        "clients": [{"name": client_names[c]} for c in client_nodes],
        "rtt_s": rtt,
        "bandwidth_bps": {a: {b: v for b, v in row.items() if math.isfinite(v)} for a, row in bw.items()},
        "workload": workload(input_tokens, output_tokens, arrival_rate),
    }


def random_geo_topology(n_nodes: int, seed: int, **kwargs) -> dict:
    """`graph_topology` on `random_geo_graph(n_nodes, seed)`; kwargs go to graph_topology."""
    kwargs.setdefault("name", f"random-geo-{n_nodes}")
    return graph_topology(random_geo_graph(n_nodes, seed), seed, **kwargs)


def write_topology(doc: dict, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(doc, indent=1) + "\n")
    return p
