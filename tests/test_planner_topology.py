"""Topology files: the issue's JSON form, YAML, cluster networks, and errors that name the field."""
from __future__ import annotations

import copy
import json

import pytest

from swarmlm.errors import PlanningError
from swarmlm.planner.topology import load_topology, parse_topology

ISSUE_EXAMPLE = {
    "model": {"num_blocks": 6, "block_bytes": 1.0e9, "cache_bytes_per_session_block": 1.0e7},
    "servers": [{"name": "s1", "memory_bytes": 4.0e9, "tau_prefill_s": [0.0001, 0.03], "tau_decode_s": 0.003}],
    "clients": [{"name": "c1"}],
    "rtt_s": {"c1": {"s1": 0.01}, "s1": {"s2": 0.02}},
    "workload": {"input_tokens": 20, "output_tokens": 128, "concurrency": 2},
}


def two_servers() -> dict:
    doc = copy.deepcopy(ISSUE_EXAMPLE)
    doc["servers"].append({"name": "s2", "memory_bytes": 4.0e9, "tau_prefill_s": [0.0001, 0.03], "tau_decode_s": 0.003})
    doc["rtt_s"]["c1"]["s2"] = 0.02
    return doc


def test_issue_example_is_accepted():
    t = parse_topology(ISSUE_EXAMPLE)
    assert t.model.num_blocks == 6 and t.workload.concurrency == 2
    assert t.servers[0].profile.prefill_s(20) == pytest.approx(0.0001 * 20 + 0.03)
    assert t.network.rtt_s("s1", "c1") == 0.01  # symmetric
    assert any("'s2'" in w for w in t.warnings)  # RTT for an undeclared name: tolerated, reported


def test_a_hops_message_cost_defaults_to_the_measured_one_and_may_be_zero():
    from swarmlm.config import MESSAGE_OVERHEAD_S

    assert parse_topology(two_servers()).perf.message_overhead_s == MESSAGE_OVERHEAD_S
    end_to_end = parse_topology({**two_servers(), "message_overhead_s": 0})  # RTTs measured end to end
    assert end_to_end.perf.message_overhead_s == 0.0
    # one decode hop through s1's 6 blocks: RTT 0.01 (+ o) + 6 x 0.003
    assert end_to_end.perf.decode_hop_s("c1", "s1", 6) == pytest.approx(0.01 + 6 * 0.003)
    assert parse_topology(two_servers()).perf.decode_hop_s("c1", "s1", 6) == pytest.approx(
        0.01 + MESSAGE_OVERHEAD_S + 6 * 0.003)


def test_yaml_and_json_files(tmp_path):
    import yaml
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(two_servers()))
    (tmp_path / "t.json").write_text(json.dumps(two_servers()))
    a, b = load_topology(tmp_path / "t.yaml"), load_topology(tmp_path / "t.json")
    assert [s.name for s in a.servers] == [s.name for s in b.servers] == ["s1", "s2"]


def test_clusters_counts_and_arrival_rate():
    doc = {
        "model": {"num_blocks": 4, "block_bytes": 1e9, "cache_bytes_per_token_block": 1e4, "session_tokens": 1000},
        "servers": [{"name": "a100", "count": 2, "memory_bytes": 8e9, "tau_prefill_s": [0, 0.03], "tau_decode_s": 0.003,
                     "cluster": "east"},
                    {"name": "mig", "count": 3, "memory_bytes": 4e9, "tau_prefill_s": [0, 0.2], "tau_decode_s": 0.016,
                     "cluster": "west"}],
        "clients": [{"name": "c", "count": 2, "cluster": "east"}],
        "clusters": {"intra_rtt_s": 0.005, "inter_rtt_s": 0.1, "inter_bandwidth_bps": 1e8},
        "workload": {"input_tokens": 20, "output_tokens": 64, "arrival_rate": 0.5},
    }
    t = parse_topology(doc)
    assert [s.name for s in t.servers] == ["a100-0", "a100-1", "mig-0", "mig-1", "mig-2"]
    assert t.model.cache_bytes_per_session_block == pytest.approx(1e7)
    assert t.network.rtt_s("c-0", "a100-1") == 0.005 and t.network.rtt_s("c-1", "mig-2") == 0.1
    assert t.network.bandwidth_bps("c-0", "mig-0") == 1e8
    assert t.workload.arrival_rate == 0.5 and t.workload.concurrency is None


def _mutate(path: list, value=None, delete: bool = False) -> dict:
    doc = two_servers()
    node = doc
    for key in path[:-1]:
        node = node[key]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return doc


@pytest.mark.parametrize("path, value, delete, message", [
    (["model", "num_blocks"], None, True, "model: missing field(s) num_blocks"),
    (["servers", 1, "memory_bytes"], -5.0, False, "servers[1] (s2).memory_bytes must be > 0"),
    (["servers", 0, "tau_decode_s"], -0.1, False, "servers[0] (s1).tau_decode_s must be >= 0"),
    (["servers", 0, "tau_prefill_s"], [0.1], False, "tau_prefill_s must be [a, b]"),
    (["servers", 0, "memroy_bytes"], 1.0, False, "unknown field(s) memroy_bytes"),
    (["servers", 0, "memory_bytes"], 5e8, False, "cannot hold even one block"),
    (["workload", "input_tokens"], 0, False, "workload.input_tokens must be >= 1"),
    (["workload", "arrival_rate"], 0.3, False, "exactly one of concurrency"),
    (["rtt_s", "c1", "s1"], -0.01, False, "rtt_s.c1.s1 must be >= 0"),
    (["rtt_s", "c1", "s2"], None, True, "no RTT between client 'c1' and server 's2'"),
    (["clients"], [], False, "clients must be a non-empty list"),
    (["model", "block_bytes"], "big", False, "model.block_bytes must be a finite number"),
    (["message_overhead_s"], -0.001, False, "message_overhead_s must be >= 0"),
])
def test_errors_name_the_field(path, value, delete, message):
    with pytest.raises(PlanningError) as info:
        parse_topology(_mutate(path, value, delete))
    assert message in str(info.value)


def test_duplicate_names_and_unknown_clusters():
    doc = two_servers()
    doc["clients"].append({"name": "s1"})
    with pytest.raises(PlanningError, match="duplicate server/client name"):
        parse_topology(doc)
    doc = two_servers()
    for s in doc["servers"]:
        s["cluster"] = "x"
    doc["clients"][0]["cluster"] = "x"
    doc["clusters"] = {"intra_rtt_s": 0.005, "inter_rtt_s": 0.1, "rtt_s": {"x": {"nowhere": 0.2}}}
    with pytest.raises(PlanningError, match="unknown cluster 'nowhere'"):
        parse_topology(doc)


def test_bad_file(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PlanningError, match="not valid JSON"):
        load_topology(tmp_path / "bad.json")
    with pytest.raises(PlanningError, match="cannot read"):
        load_topology(tmp_path / "missing.json")


def test_documented_examples_parse():
    import re
    from pathlib import Path

    import yaml
    text = (Path(__file__).resolve().parents[1] / "docs" / "TOPOLOGY_FORMAT.md").read_text()
    docs = [json.loads(b) for b in re.findall(r"```json\n(.*?)```", text, re.S)]
    docs += [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, re.S)]
    assert len(docs) == 2
    for doc in docs:
        t = parse_topology(doc)
        assert t.servers and t.clients and not t.warnings


def test_arrival_rate_gives_littles_law_concurrency():
    from swarmlm.planner.plan import make_plan
    doc = two_servers()
    doc["workload"] = {"input_tokens": 20, "output_tokens": 128, "arrival_rate": 2.0, "max_concurrency": 3}
    plan = make_plan(parse_topology(doc), "cg-bprr")
    # T = one request on [0,3) + [3,6) ~ 6.4 s; lambda T ~ 12.6 -> 16, capped at 3
    assert plan.concurrency == 3
    doc["workload"] = {"input_tokens": 20, "output_tokens": 128, "arrival_rate": 0.05}
    plan = make_plan(parse_topology(doc), "cg-bprr")
    assert plan.concurrency == 1  # round(0.32 + 0.57) = 1


def test_bandwidth_without_rtt_is_still_a_missing_rtt():
    doc = two_servers()
    del doc["rtt_s"]["c1"]["s2"]
    doc["bandwidth_bps"] = {"c1": {"s2": 1e9}}
    with pytest.raises(PlanningError, match="no RTT between client 'c1' and server 's2'"):
        parse_topology(doc)
    doc["rtt_s"]["c1"]["s2"] = 0.02
    t = parse_topology(doc)
    assert t.network.bandwidth_bps("s2", "c1") == 1e9 and t.network.rtt_s("c1", "s2") == 0.02
