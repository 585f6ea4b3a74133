"""Arrival processes, trace files, topology generators and the GraphML loader."""
from __future__ import annotations

import json

import networkx as nx
import numpy as np
import pytest

from swarmlm.planner.topology import parse_topology
from swarmlm.sim.arrivals import ArrivalSpec, generate
from swarmlm.sim.generators import (FIBRE_S_PER_KM, PAPER_CLUSTERS, ClusterSpec, clustered_topology,
                                    random_geo_graph, random_geo_topology)
from swarmlm.sim.graphml import graphml_topology, haversine_km, load_graphml


def test_poisson_count_duration_and_rate():
    reqs = generate(ArrivalSpec("poisson", 2.0, count=4000), ["a", "b"], seed=1)
    times = np.array([r.arrival_s for r in reqs])
    assert len(reqs) == 4000 and times[0] == 0.0 and np.all(np.diff(times) >= 0)
    assert np.mean(np.diff(times)) == pytest.approx(0.5, rel=0.05)  # 1 / rate
    assert {r.client_id for r in reqs} == {"a", "b"}
    by_time = generate(ArrivalSpec("poisson", 2.0, duration_s=100.0), ["a"], seed=1)
    assert all(r.arrival_s <= 100.0 for r in by_time) and 150 < len(by_time) < 250
    fixed = generate(ArrivalSpec("fixed", count=3, interval_s=0.5, input_tokens=7, output_tokens=9), ["a"], 0)
    assert [(r.arrival_s, r.input_tokens, r.output_tokens) for r in fixed] == [(0.0, 7, 9), (0.5, 7, 9), (1.0, 7, 9)]
    with pytest.raises(ValueError):
        ArrivalSpec("poisson", 1.0, count=5, duration_s=5.0)
    with pytest.raises(ValueError):
        ArrivalSpec("poisson", 0.0, count=5)


def test_trace_files_csv_and_jsonl(tmp_path):
    csv_path = tmp_path / "t.csv"
    csv_path.write_text("# a comment\narrival_s,input_tokens,output_tokens,client\n2.5,10,4,b\n0.5,20,8,\n")
    reqs = generate(ArrivalSpec("trace", trace_path=str(csv_path)), ["a", "b"], seed=0)
    assert [(r.request_id, r.arrival_s, r.input_tokens, r.output_tokens) for r in reqs] == [(0, 0.5, 20, 8),
                                                                                            (1, 2.5, 10, 4)]
    assert reqs[1].client_id == "b"
    jl = tmp_path / "t.jsonl"
    jl.write_text("\n".join(json.dumps(d) for d in ({"arrival_s": 1, "input_tokens": 3, "output_tokens": 2},)))
    assert generate(ArrivalSpec("trace", trace_path=str(jl)), ["a"], 0)[0].input_tokens == 3
    bad = tmp_path / "bad.csv"
    bad.write_text("arrival_s,input_tokens\n1,2\n")
    with pytest.raises(ValueError, match="row 1"):
        generate(ArrivalSpec("trace", trace_path=str(bad)), ["a"], 0)


def test_clustered_topology_is_the_papers_setting():
    topo = parse_topology(clustered_topology(PAPER_CLUSTERS, 20, 64, 0.5))
    assert len(topo.servers) == 9 and len(topo.clients) == 3 and topo.model.num_blocks == 70
    assert topo.model.block_bytes == pytest.approx(1.32e9, rel=0.01)
    assert topo.network.rtt_s("cpu-client-0", "gpu-a100-0") == pytest.approx(0.1)
    assert topo.network.rtt_s("mig-client-0", "mig-mig-3") == pytest.approx(0.005)
    assert topo.network.bandwidth_bps("gpu-client-0", "gpu-a100-1") == pytest.approx(1e9)
    assert topo.network.bandwidth_bps("gpu-client-0", "mig-mig-1") == pytest.approx(1e8)
    big = parse_topology(clustered_topology([ClusterSpec(f"c{i}", a100=2, mig=8, clients=1) for i in range(5)]))
    assert len(big.servers) == 50


def test_random_geo_rtt_is_twice_the_shortest_path_delay():
    g = random_geo_graph(30, seed=4)
    assert nx.is_connected(g) and g.number_of_nodes() == 30
    for u, v, d in g.edges(data=True):
        assert d["delay_s"] == pytest.approx(d["km"] * FIBRE_S_PER_KM)
    doc = random_geo_topology(30, seed=4, n_servers=10, n_clients=2)
    topo = parse_topology(doc)
    assert len(topo.servers) == 10 and len(topo.clients) == 2
    assert sum(s.name.startswith("a100") for s in topo.servers) == 2  # 20 % A100-class
    client, server = topo.clients[0].name, topo.servers[0].name
    cn, sn = int(client.split("-")[1]), int(server.split("-")[1])
    assert topo.network.rtt_s(client, server) == pytest.approx(
        2 * nx.shortest_path_length(g, cn, sn, weight="delay_s"))
    assert random_geo_topology(30, seed=4) == random_geo_topology(30, seed=4)  # deterministic per seed


def test_graphml_loader_uses_delays_then_coordinates(tmp_path):
    g = nx.Graph()
    g.add_node("A", Latitude=40.0, Longitude=-74.0)
    g.add_node("B", Latitude=41.0, Longitude=-74.0)
    g.add_node("C", Latitude=42.0, Longitude=-75.0)
    g.add_node("D")  # no coordinates
    g.add_edge("A", "B", delay_ms=3.0, LinkSpeedRaw=1e10)
    g.add_edge("B", "C")
    g.add_edge("C", "D")
    g.add_node("lonely", Latitude=0.0, Longitude=0.0)  # not connected: dropped
    path = tmp_path / "zoo.graphml"
    nx.write_graphml(g, path)
    loaded = load_graphml(path, default_delay_s=0.002)
    assert set(loaded.nodes) == {"A", "B", "C", "D"}
    assert loaded.edges["A", "B"]["delay_s"] == pytest.approx(0.003)
    assert loaded.edges["A", "B"]["bandwidth_bps"] == pytest.approx(1e10)
    assert loaded.edges["B", "C"]["delay_s"] == pytest.approx(haversine_km(41, -74, 42, -75) * FIBRE_S_PER_KM)
    assert loaded.edges["C", "D"]["delay_s"] == pytest.approx(0.002) and loaded.graph["defaulted_delays"] == 1
    topo = parse_topology(graphml_topology(path, seed=0, n_servers=3, n_clients=1))
    assert len(topo.servers) == 3
