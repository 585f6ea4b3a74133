"""The shared PerfModel: sizes from a model config, networks, validation."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from swarmlm.perf.model import ComputeProfile, ModelSpec, Network, PerfModel, Workload
from swarmlm.types import Span


def test_model_spec_from_a_bloom_like_config():
    # BLOOM-176B in NF4: 12 h^2 parameters a block at 4.25 bits (+1%) = 1.32 GB, s_c = 2 h (l_in + l_max) 2 bytes
    cfg = SimpleNamespace(hidden_size=14336, num_hidden_layers=70, num_attention_heads=112)
    m = ModelSpec.from_config(cfg, l_in_max=20, l_max=128, weight_bytes_per_param=4.25 / 8 * 1.01)
    assert m.num_blocks == 70
    assert m.block_bytes == pytest.approx(1.32e9, rel=0.01)
    assert m.cache_bytes_per_session_block == 2 * 14336 * 148 * 2
    assert m.hidden_bytes_per_token == 14336 * 2 and m.session_tokens == 148


def test_model_spec_from_a_gqa_config_uses_kv_heads():
    cfg = SimpleNamespace(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                          intermediate_size=14336, hidden_act="silu")
    m = ModelSpec.from_config(cfg, 512, 512)
    assert m.cache_bytes_per_session_block == 2 * (8 * 128) * 1024 * 2
    assert m.block_bytes == (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336) * 2


def test_network_matrix_clusters_and_defaults():
    net = Network.from_clusters({"a": "x", "b": "x", "c": "y"}, 0.005, 0.1, 1e9, 1e8, pair_rtt_s={("y", "x"): 0.2})
    assert net.rtt_s("a", "b") == 0.005 and net.rtt_s("c", "a") == 0.2
    assert net.bandwidth_bps("a", "c") == 1e8
    net.set_link("a", "c", 0.05)  # a measured RTT overrides the cluster rule
    assert net.rtt_s("c", "a") == 0.05
    with pytest.raises(KeyError, match="'a' and 'zz'"):
        net.rtt_s("a", "zz")
    m = Network.from_matrix({"c": {"s": 0.01}}, default_rtt_s=0.3)
    assert m.rtt_s("s", "c") == 0.01 and m.rtt_s("c", "t") == 0.3


def test_perf_model_without_topology_and_live_updates():
    net = Network()
    net.set_link("c", "s", 0.02)
    perf = PerfModel({"s": ComputeProfile(0.0, 0.05, 0.004)}, net, message_overhead_s=0.001)
    spans = [Span("s", 0, 10)]
    assert perf.ttft_s("c", spans, 20) == pytest.approx(0.02 + 0.001 + 10 * 0.05)  # RTT + o + compute
    assert perf.decode_step_s("c", spans) == pytest.approx(0.02 + 0.001 + 10 * 0.004)
    perf.set_profile("s", ComputeProfile(0.0, 0.05, 0.002))  # the server re-announced a faster profile
    assert perf.decode_step_s("c", spans) == pytest.approx(0.02 + 0.001 + 10 * 0.002)
    # 5 round trips (the prompt's, then 4 tokens'), each RTT + o; per block: the prompt + 4 decode steps
    assert perf.hop_cost_terms("c", "s", 20, 5) == pytest.approx((5 * (0.02 + 0.001), 0.05 + 4 * 0.002))


@pytest.mark.parametrize("make", [
    lambda: ComputeProfile(-1.0, 0.0, 0.0),
    lambda: ComputeProfile(0.0, float("nan"), 0.0),
    lambda: ModelSpec(0, 1.0, 1.0),
    lambda: ModelSpec(4, 0.0, 1.0),
    lambda: Workload(0, 10),
    lambda: Workload(10, 10, concurrency=0),
    lambda: Workload(10, 10, arrival_rate=-1.0),
])
def test_specs_validate(make):
    with pytest.raises(ValueError):
        make()


def test_memoised_hop_costs_follow_network_and_profile_changes():
    net = Network()
    net.set_link("c", "s", 0.02)
    perf = PerfModel({"s": ComputeProfile(0.0, 0.05, 0.004)}, net, message_overhead_s=0.001)
    assert perf.hop_cost_terms("c", "s", 20, 2)[0] == pytest.approx(2 * (0.02 + 0.001))  # 2 round trips, RTT + o
    net.set_link("s", "c", 0.1)  # a new RTT measurement
    assert perf.hop_cost_terms("c", "s", 20, 2)[0] == pytest.approx(2 * (0.1 + 0.001))
    perf.set_profile("s", ComputeProfile(0.0, 0.01, 0.004))
    assert perf.hop_cost_terms("c", "s", 20, 2)[1] == pytest.approx(0.01 + 0.004)
