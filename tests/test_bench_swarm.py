"""The benchmark against real server processes (tiny BLOOM): same tokens under every strategy, a decomposition
that adds up, telemetry for every process, the CLI's results, and a network profile that really applies."""
from __future__ import annotations

import json
import time

import pytest
import torch
from transformers import AutoTokenizer

from swarmlm.bench.runner import BenchConfig, start_swarm
from swarmlm.bench.strategies import STRATEGIES, StrategyConfig, run_strategy, split_evenly
from swarmlm.bench.telemetry import TelemetrySampler
from swarmlm.bench.workload import builtin_prompts, poisson_arrivals, tokenize
from swarmlm.cli.main import main as cli_main
from swarmlm.swarm.local import even_split
from tests.swarm_helpers import running_swarm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(tiny_bloom):
    with running_swarm(tiny_bloom, even_split(6, 3)) as (_, model):
        yield model


@pytest.fixture(scope="module")
def requests(tiny_bloom):
    return tokenize(builtin_prompts(), AutoTokenizer.from_pretrained(tiny_bloom), max_new_tokens=8, limit=9)


@pytest.fixture(scope="module")
def reference(client, requests):
    """Plain sequential greedy generation, one prompt at a time, through the client's own generate()."""
    out = {}
    for r in requests:
        ids = torch.tensor([r.input_ids])
        new = client.generate(ids, max_new_tokens=r.max_new_tokens)[0, ids.shape[1]:].tolist()
        out[r.request_id] = tuple(new[:new.index(2) + 1] if 2 in new else new)  # eos id 2 ends a row
    return out


@pytest.mark.parametrize("cfg", [StrategyConfig(n) for n in STRATEGIES] + [
    StrategyConfig("pipelined", in_flight=5), StrategyConfig("microbatched", micro_batches=2, micro_batch_size=3),
    StrategyConfig("microbatched", micro_batches="auto"),
    StrategyConfig("sequential", head_last_only=False)], ids=lambda c: f"{c.label(3)}-{c.head_last_only}")
def test_every_strategy_gives_the_sequential_greedy_tokens(client, requests, reference, cfg):
    decisions: list[dict] = []
    records = run_strategy(client, requests, cfg, route_servers=3, decisions=decisions)
    assert [r.request_id for r in records] == [r.request_id for r in requests]
    assert all(r.error is None for r in records)
    assert {r.request_id: r.tokens for r in records} == reference
    if cfg.auto:  # MoLink's rule chose every batch's split, from measured times once it had them
        assert len(decisions) == -(-len(requests) // 6) and decisions[0]["reason"] == "no measurement yet"
        assert all(d["t_comp_s"] > 0 and d["t_trans_s"] > 0 and 1 <= d["micro_batches"] <= d["requests"]
                   for d in decisions[1:])
        for i, d in enumerate(decisions):  # and the batch ran as exactly that many micro-batches
            parts = split_evenly(range(d["requests"]), d["micro_batches"])
            assert sorted(r.batch_size for r in records[6 * i:6 * (i + 1)]) == sorted(
                len(p) for p in parts for _ in p)
    elif cfg.name == "microbatched":
        assert {r.batch_size for r in records} >= {cfg.micro_batch_size}
    else:
        assert {r.batch_size for r in records} == {1}
    for r in records:  # every request's parts, each from its own clocks, add up to its response time
        d = r.decomposition
        assert d.measured_s == pytest.approx(r.response_s)
        assert min(d.parts().values()) >= 0 and d.computation_s > 0 and d.communication_s > 0
        assert 0 < r.ttft_s < r.response_s and r.payload_sent_bytes > r.payload_received_bytes > 0
    # ...up to what no clock covers: a part left out would show in every request; one request's share may grow
    # when a busy machine stalls the client between two clocks, so the median is what is checked, against 10 %:
    # the smallest part here (queueing) is 6-10 % of a request, orchestration ~17 %; a busy machine (load 6, a
    # benchmark beside the suite) was seen to leave 5.1 % uncovered
    residuals = sorted(r.decomposition.residual_fraction for r in records)
    assert residuals[len(residuals) // 2] < 0.10, [r.decomposition.to_dict() for r in records]


def test_open_loop_arrivals_wait_at_the_client_and_count_as_queueing(client, requests):
    arriving = poisson_arrivals(requests[:4], rate_per_s=2.0, seed=5)
    records = run_strategy(client, arriving, StrategyConfig("sequential"), route_servers=3)
    for req, rec in zip(arriving, records):
        assert rec.arrival_s == pytest.approx(req.arrival_s, abs=0.05)
        assert rec.start_s >= rec.arrival_s - 1e-6  # nothing starts before it arrives (a busy machine only delays)
        assert rec.decomposition.detail_s["client_queue"] >= 0
    # what no clock covers, as in the strategies' test and against the same 10 % (a part left out would show in every
    # request; 5.4 % was seen uncovered with the whole suite on a slow day)
    residuals = sorted(r.decomposition.residual_fraction for r in records)
    assert residuals[len(residuals) // 2] < 0.10, [r.decomposition.to_dict() for r in records]


def test_cli_bench_writes_results_with_telemetry_for_every_process(tiny_bloom, tmp_path):
    out = tmp_path / "out"
    code = cli_main(["bench", "--model", tiny_bloom, "--servers", "1,2", "--strategies", "sequential,pipelined",
                     "--prompts", "builtin", "--limit", "12", "--max-new-tokens", "16", "--out", str(out)])
    assert code == 0
    doc = json.loads((out / "results.json").read_text())
    runs = doc["runs"]
    assert [(r["servers"], r["strategy"]) for r in runs] == [(1, "sequential"), (1, "pipelined"), (2, "sequential"),
                                                              (2, "pipelined")]
    for r in runs:
        assert set(r["decomposition_s"]) == {"computation", "communication", "queueing", "orchestration"}
        assert r["throughput_tokens_per_s"] > 0 and r["mean_response_s"] > 0 and len(r["requests"]) == 12
        assert {"response_s", "ttft_s", "generated_tokens"} <= set(r["requests"][0])
        # a part left out (computation, the wire) would be a third of the time or more; a busy machine's stalls
        # between two clocks are a few per cent (7 % seen beside two busy-loops), so the bound is 15 %
        assert abs(r["decomposition_residual_s"]) < 0.15 * r["decomposition_measured_s"]
        expected = {"client", "dht", "system"} | {f"server{i}" for i in range(r["servers"])}
        assert set(r["telemetry"]) == expected  # a sample of every process inside every run's window
        assert all(r["telemetry"][f"server{i}"]["median_rtt_s"] for i in range(r["servers"]))
        assert r["network_tx_bytes"] >= r["payload_bytes"] > 0  # TCP carries at least the tensors
    assert runs[0]["speedup_throughput"] == pytest.approx(1.0)
    for name in ("report.md", "runs.csv", "requests.csv", "telemetry.csv", "throughput_vs_n.png",
                 "response_vs_n.png", "decomposition.png", "telemetry.png", "network_bytes_vs_n.png"):
        assert (out / name).stat().st_size > 0, name


def _info_rtts(swarm, count: int = 20, timeout_s: float = 120.0) -> list[float]:
    """`count` Info round trips to server0, sampled 0.25 s apart (a busy machine may take longer to give them)."""
    def rtts() -> list[float]:
        return [s.rtt_s for s in list(sampler.samples) if s.name == "server0" and s.rtt_s is not None]

    deadline = time.monotonic() + timeout_s
    with TelemetrySampler(swarm.tracked, interval_s=0.25) as sampler:
        while len(rtts()) < count and time.monotonic() < deadline:
            time.sleep(0.25)
    return rtts()


def test_network_profile_changes_measured_rtt_and_bandwidth(tiny_bloom, tmp_path):
    """The same one-server swarm on loopback and behind a 40 ms / 20 Mbit/s profile file."""
    topo = tmp_path / "topo.json"
    topo.write_text(json.dumps({"servers": [{"name": "s", "cluster": "site", "count": 1}],
                                "clients": [{"name": "c", "cluster": "site"}],
                                "clusters": {"intra_rtt_s": 0.040, "intra_bandwidth_bps": 20e6}}))
    base = dict(model_dir=tiny_bloom, servers=(1,), strategies=(StrategyConfig("sequential"),))
    with start_swarm(BenchConfig(**base), 1, 6) as swarm:
        loopback = _info_rtts(swarm)
    with start_swarm(BenchConfig(**base, network=str(topo)), 1, 6) as swarm:
        emulated = _info_rtts(swarm)
        info = swarm.network_info
    assert len(loopback) >= 20 and len(emulated) >= 20, (loopback, emulated)
    # A busy machine only ever adds time, so only bounds that load cannot break are checked here: the fastest
    # round trip is never below the profile's 40 ms when it applies (and is below it without the profile), and
    # goodput never exceeds 20 Mbit/s. How closely the emulation follows a profile is measured by
    # `python -m swarmlm.bench.netem.accuracy` (docs/NETWORK_EMULATION.md).
    assert min(emulated) > 0.038 and min(loopback) < min(emulated), (loopback, emulated)
    assert info["measured_rtt_s"] > 0.038, info  # netem's own echo probe (median), same relay
    for key in ("measured_up_bps", "measured_down_bps"):  # goodput: 20 Mbit/s minus headers, never above
        assert 0.25 * 20e6 < info[key] < 1.02 * 20e6, info


def test_microbatched_speculation_gives_greedy_rows_and_each_rows_drafts(client, requests, tiny_bloom):
    """A micro-batch of 3 speculates row by row (client/decoding/rows.py): greedy up to ties (a batch is not
    bit-identical to one row), and each request's record counts its own row's drafts, not the batch's."""
    from tests.swarm_helpers import assert_greedy_up_to_ties

    cfg = StrategyConfig("microbatched", micro_batches=1, micro_batch_size=3, speculative="4")
    records = run_strategy(client, requests[:3], cfg, route_servers=1)
    assert all(r.error is None for r in records) and {r.batch_size for r in records} == {3}
    for r, req in zip(records, requests[:3]):
        assert_greedy_up_to_ties(tiny_bloom, req.input_ids, list(r.tokens))
    spec = client.last_stats.speculation  # the batch's generate() call (the only one)
    assert [r.drafted for r in records] == [row["drafted"] for row in spec["rows"]]
    assert sum(r.drafted for r in records) == spec["drafted"] > 0
