"""Link profiles, link matrices and the tolerant topology-file reader (no processes, no rights needed)."""
import json

import pytest

from swarmlm.bench.netem import CLIENT, LinkMatrix, LinkProfile, load_named_links, network_for, preset


def test_presets_match_the_issue():
    assert preset("lan") == LinkProfile(rtt_s=0.001, rate_bps=1e9)
    assert preset("wan") == LinkProfile(rtt_s=0.050, rate_bps=100e6)
    with pytest.raises(ValueError, match="unknown network profile"):
        preset("dialup")


@pytest.mark.parametrize("kwargs, message", [
    (dict(rtt_s=-0.001), "rtt_s"),
    (dict(rtt_s=0.01, rate_bps=0), "rate_bps"),
    (dict(rtt_s=0.01, jitter_s=0.006), "exceeds the one-way delay"),
    (dict(rtt_s=0.01, loss=1.0), "loss"),
    (dict(rtt_s=float("nan")), "rtt_s"),
])
def test_profile_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LinkProfile(**kwargs)


def test_loss_caps_the_rate_by_the_mathis_bound():
    lossy = LinkProfile(rtt_s=0.05, rate_bps=1e9, loss=0.01)
    # MSS/RTT * sqrt(1.5/p) = 1448*8/0.05 * 12.25 ~ 2.8 Mbit/s, far below the 1 Gbit/s line rate
    assert 2.7e6 < lossy.effective_rate_bps < 2.9e6
    assert LinkProfile(rtt_s=0.05, rate_bps=1e9).effective_rate_bps == 1e9


def test_star_matrix_adds_both_access_links_between_hosts():
    a, b = LinkProfile(rtt_s=0.010, rate_bps=1e9), LinkProfile(rtt_s=0.030, rate_bps=1e8, jitter_s=0.001)
    m = LinkMatrix.star([a, b])
    assert m.link(CLIENT, 0) == a and m.link(1, CLIENT) == b
    between = m.link(0, 1)
    assert between.rtt_s == pytest.approx(0.040) and between.rate_bps == 1e8 and between.jitter_s == 0.001
    with pytest.raises(ValueError, match="neither CLIENT nor a host"):
        m.link(0, 2)


def test_planner_topology_file_with_explicit_rtts(tmp_path):
    # the minimal example of docs/TOPOLOGY_FORMAT.md, plus a bandwidth
    path = tmp_path / "topo.json"
    path.write_text(json.dumps({
        "model": {"num_blocks": 6, "block_bytes": 1.0e9, "cache_bytes_per_session_block": 1.0e7},
        "servers": [{"name": "s1", "memory_bytes": 4.0e9, "tau_prefill_s": [0.0001, 0.03], "tau_decode_s": 0.003},
                    {"name": "s2", "memory_bytes": 4.0e9, "tau_prefill_s": [0.0001, 0.03], "tau_decode_s": 0.003}],
        "clients": [{"name": "c1"}],
        "rtt_s": {"c1": {"s1": 0.01, "s2": 0.02}},
        "bandwidth_bps": {"s2": {"c1": 5e7}},
        "workload": {"input_tokens": 20, "output_tokens": 128, "concurrency": 2}}))
    links = load_named_links(path)
    assert links.link("s1", "c1") == LinkProfile(rtt_s=0.01)
    assert links.link("c1", "s2") == LinkProfile(rtt_s=0.02, rate_bps=5e7)  # one direction given is enough
    with pytest.raises(ValueError, match="no RTT between 's1' and 's2'"):
        links.link("s1", "s2")  # the planner does not need server-server RTTs; a testbed with them does
    m = LinkMatrix.from_named(links, host_names=["s1", "s2"], client_name="c1")
    assert m.link(CLIENT, 1).rtt_s == 0.02 and m.link(0, CLIENT).rtt_s == 0.01
    assert m.link(0, 1) == LinkProfile(rtt_s=0.03, rate_bps=5e7)  # via the client: both links in series


def test_planner_topology_file_with_clusters_yaml(tmp_path):
    path = tmp_path / "topo.yaml"
    path.write_text(
        "servers:\n"
        "  - {name: a100, count: 2, cluster: a100}\n"
        "  - {name: mig, count: 3, cluster: mig}\n"
        "clients:\n"
        "  - {name: cpu, cluster: cpu}\n"
        "clusters: {intra_rtt_s: 0.005, inter_rtt_s: 0.1, intra_bandwidth_bps: 1.0e9, inter_bandwidth_bps: 1.0e8,\n"
        "           rtt_s: {cpu: {mig: 0.03}}}\n"
        "rtt_s: {cpu: {a100-1: 0.2}}\n")
    links = load_named_links(path)
    assert links.link("a100-0", "a100-1") == LinkProfile(rtt_s=0.005, rate_bps=1e9)
    assert links.link("mig-2", "cpu") == LinkProfile(rtt_s=0.03, rate_bps=1e8)  # per-cluster-pair RTT
    assert links.link("cpu", "a100-0") == LinkProfile(rtt_s=0.1, rate_bps=1e8)  # inter rule
    assert links.link("cpu", "a100-1").rtt_s == 0.2  # explicit node pair overrides the cluster rule
    m = LinkMatrix.from_named(links, host_names=["a100-0", "a100-1", "mig-0"], client_name="cpu")
    assert m.link(0, 1).rtt_s == 0.005 and m.link(1, 2).rtt_s == 0.1 and m.link(CLIENT, 2).rtt_s == 0.03
    assert links.servers == ("a100-0", "a100-1", "mig-0", "mig-1", "mig-2") and links.clients == ("cpu",)
    assert network_for(str(path), 3) == m  # --network FILE: the first servers are the hosts
    assert network_for("wan", 2) == LinkMatrix.uniform(2, preset("wan"))
    with pytest.raises(ValueError, match="need 6 servers"):
        network_for(str(path), 6)
    with pytest.raises(ValueError, match="neither a preset"):
        network_for("no-such-file.yaml", 2)


def test_topology_file_errors(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"rtt_s": {"a": 0.01}}))
    with pytest.raises(ValueError, match="rtt_s must be a mapping"):
        load_named_links(path)
    path.write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="expected a mapping"):
        load_named_links(path)
    path.write_text(json.dumps({"default_rtt_s": 0.04, "rtt_s": {"a": {"b": -1}}}))
    assert load_named_links(path).link("x", "y").rtt_s == 0.04
    with pytest.raises(ValueError, match="rtt_s must be finite and >= 0"):
        load_named_links(path).link("a", "b")
