"""The benchmark's pieces without a swarm: workloads, the decomposition's arithmetic, ss parsing, windows."""
from __future__ import annotations

import json
import statistics
from types import SimpleNamespace

import pytest
from transformers import PreTrainedTokenizerFast

from swarmlm.bench.decomposition import decompose, mean_decomposition
from swarmlm.bench.strategies import StrategyConfig, split_evenly
from swarmlm.bench.telemetry import Sample, parse_ss, summarize
from swarmlm.bench.workload import (LengthSpec, PromptSpec, builtin_prompts, fixed_length, load_prompt_file,
                                    poisson_arrivals, synthetic, tokenize)
from swarmlm.client.streams import HopTiming
from swarmlm.model.tokenizer import save_tokenizer


@pytest.fixture(scope="module")
def bloomz_tokenizer(tmp_path_factory):
    """The tokenizer the bloomz-560m preset ships (4096 merges), without writing 2 GB of weights."""
    path = tmp_path_factory.mktemp("tok")
    save_tokenizer(4096, path)
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def test_prompt_files_text_and_jsonl(tmp_path):
    text = tmp_path / "p.txt"
    text.write_text("first prompt\n\n  second prompt  \n")
    assert [p.text for p in load_prompt_file(text)] == ["first prompt", "second prompt"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt": "a", "max_new_tokens": 3}) + "\n" + json.dumps({"prompt": "b"}) + "\n")
    assert load_prompt_file(jsonl) == [PromptSpec("a", 3), PromptSpec("b")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_prompt_file(bad)


def test_builtin_prompts_are_many_varied_and_5_to_120_tokens(bloomz_tokenizer):
    prompts = builtin_prompts()
    assert len(prompts) >= 200 and len({p.text for p in prompts}) == len(prompts)
    lengths = [len(r.input_ids) for r in tokenize(prompts, bloomz_tokenizer, 10)]
    assert min(lengths) >= 5 and max(lengths) <= 120
    assert 25 <= statistics.mean(lengths) <= 50  # the study's mix averaged ~35 tokens
    assert len({p.text.split()[0] for p in prompts}) > 30  # not one template repeated


def test_tokenize_limit_and_per_prompt_max_new_tokens(bloomz_tokenizer):
    reqs = tokenize([PromptSpec("hello world", 3), PromptSpec("the sea"), PromptSpec("x y z")], bloomz_tokenizer, 10,
                    limit=2)
    assert [r.max_new_tokens for r in reqs] == [3, 10] and [r.request_id for r in reqs] == [0, 1]


def test_synthetic_lengths_and_poisson_arrivals():
    assert {len(r.input_ids) for r in fixed_length(20, 17, 512, 5)} == {17}
    spec = LengthSpec("lognormal", mean_tokens=40, spread=0.5, min_tokens=5, max_tokens=120)
    lengths = [len(r.input_ids) for r in synthetic(2000, spec, 512, 5, seed=3)]
    assert min(lengths) >= 5 and max(lengths) <= 120 and 35 < statistics.mean(lengths) < 45
    assert all(4 <= t < 512 for r in synthetic(50, spec, 512, 5) for t in r.input_ids)
    arrivals = [r.arrival_s for r in poisson_arrivals(fixed_length(4001, 4, 512, 1), rate_per_s=5.0, seed=1)]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert arrivals[0] == 0 and min(gaps) >= 0 and abs(statistics.mean(gaps) - 0.2) < 0.02
    with pytest.raises(ValueError):
        LengthSpec("zipf")


def test_strategy_config_is_validated():
    assert StrategyConfig("pipelined").workers(4) == 4 and StrategyConfig("pipelined", in_flight=6).workers(4) == 6
    assert StrategyConfig("sequential").workers(4) == 1 and StrategyConfig("microbatched").workers(3) == 3
    for bad in (dict(name="greedy"), dict(name="pipelined", in_flight=0), dict(name="sequential", in_flight=2),
                dict(name="microbatched", micro_batch_size=0)):
        with pytest.raises(ValueError):
            StrategyConfig(**bad)


def _hop(wall, queued, compute, server_io, client_io):
    return HopTiming("s", wall_s=wall, queued_s=queued, compute_s=compute, server_io_s=server_io,
                     client_io_s=client_io, n_tokens=1)


def test_decomposition_parts_come_from_their_own_clocks():
    stats = SimpleNamespace(embed_s=0.01, head_s=0.2, sample_s=0.03)
    steps = [SimpleNamespace(wall_s=0.5, failover_s=0.0, hops=[_hop(0.2, 0.05, 0.1, 0.01, 0.01),
                                                             _hop(0.25, 0.0, 0.2, 0.01, 0.02)]),
             SimpleNamespace(wall_s=1.0, failover_s=0.4, hops=[_hop(0.3, 0.0, 0.25, 0.02, 0.01)])]
    d = decompose(measured_s=2.0, open_s=0.1, close_s=0.05, client_wait_s=0.0, stats=stats, call_s=[0.52, 1.03],
                  steps=steps)
    assert d.computation_s == pytest.approx(0.01 + 0.2 + 0.03 + 0.1 + 0.2 + 0.25)
    assert d.queueing_s == pytest.approx(0.05)
    # transfer = wall - queued - compute - server io, plus both sides' (de)serialisation
    assert d.communication_s == pytest.approx((0.04 + 0.04 + 0.03) + (0.01 + 0.01 + 0.02) + (0.01 + 0.02 + 0.01))
    # open + close + failover + hand-offs (0.02 + 0.03) + the session's gaps between hops
    gaps = (0.5 - 0.21 - 0.27) + (1.0 - 0.4 - 0.31)
    assert d.orchestration_s == pytest.approx(0.1 + 0.05 + 0.4 + 0.05 + gaps)
    assert d.residual_s == pytest.approx(2.0 - d.accounted_s) and d.residual_s > 0  # not forced to zero
    with pytest.raises(ValueError):
        decompose(1.0, 0, 0, 0, stats, [0.1], steps)
    m = mean_decomposition([d, d])
    assert m.computation_s == pytest.approx(d.computation_s) and m.measured_s == 2.0



def test_overlapping_hops_of_a_pipelined_prefill_share_the_steps_wall():
    stats = SimpleNamespace(embed_s=0.0, head_s=0.0, sample_s=0.0)
    # 2 chunks through 2 spans, pipelined: the four hops' clocks add up to 0.8 s within a 0.5 s step
    hops = [_hop(0.2, 0.02, 0.15, 0.01, 0.0) for _ in range(4)]
    d = decompose(measured_s=0.5, open_s=0.0, close_s=0.0, client_wait_s=0.0, stats=stats, call_s=[0.5],
                  steps=[SimpleNamespace(wall_s=0.5, failover_s=0.0, hops=hops)])
    assert min(d.parts().values()) >= 0 and d.detail_s["hop_gaps"] == pytest.approx(0.0)
    assert d.detail_s["overlap"] == pytest.approx(0.3) and d.accounted_s == pytest.approx(0.5)
    assert d.computation_s / d.communication_s == pytest.approx(0.6 / (4 * 0.03))  # shares kept
    assert d.queueing_s == pytest.approx(0.08 * 0.5 / 0.8)


SS_OUTPUT = """\
ESTAB 0      0      127.0.0.1:40100 127.0.0.1:51234 users:(("python",pid=111,fd=7))
\t cubic wscale:7,7 rto:204 rtt:0.1/0.05 bytes_sent:5000 bytes_acked:4800 bytes_received:900 segs_out:10
ESTAB 0      0      127.0.0.1:51234 127.0.0.1:40100 users:(("python",pid=222,fd=9),("python",pid=223,fd=9))
\t cubic bytes_acked:901 bytes_received:4800
LISTEN 0      4096   127.0.0.1:40100 0.0.0.0:* users:(("python",pid=111,fd=5))
\t cubic rto:1000
"""


def test_parse_ss_reads_per_socket_bytes_and_owners():
    got = parse_ss(SS_OUTPUT)
    assert got[("127.0.0.1:40100", "127.0.0.1:51234")] == (4800, 900, (111,))
    assert got[("127.0.0.1:51234", "127.0.0.1:40100")] == (901, 4800, (222, 223))
    assert got[("127.0.0.1:40100", "0.0.0.0:*")] == (0, 0, (111,))


def test_summarize_takes_byte_deltas_across_the_window():
    rows = [Sample(t, "server0", 50.0 + t, 100 + t, 1000 * t, 10 * t, 0.002) for t in range(6)]
    s = summarize(rows, 1.5, 3.5)["server0"]
    assert s.samples == 2 and s.tx_bytes == 3000 and s.rx_bytes == 30  # from t=1 (before) to t=4 (after)
    assert s.mean_cpu_percent == pytest.approx(52.5) and s.median_rtt_s == 0.002
    short = summarize(rows, 2.2, 2.4)["server0"]  # shorter than one interval: the next sample speaks for it
    assert short.samples == 1 and short.tx_bytes == 1000


def test_split_evenly_gives_exactly_the_asked_number_of_near_equal_parts():
    assert [len(p) for p in split_evenly(list(range(8)), 7)] == [2, 1, 1, 1, 1, 1, 1]
    assert split_evenly([1, 2, 3, 4, 5], 2) == [[1, 2, 3], [4, 5]]
    assert split_evenly([1, 2], 5) == [[1], [2]]  # never an empty micro-batch
    assert split_evenly([1, 2, 3], 0) == [[1, 2, 3]]


def test_run_totals_give_ttft_and_per_token_percentiles_over_requests():
    from swarmlm.bench.strategies import RequestRecord, totals

    def rec(i: int, ttft: float, per_token: float, error: str | None = None) -> RequestRecord:
        response = ttft + 4 * per_token  # 5 generated tokens
        return RequestRecord(i, 8, 5, (1,) * 5, 0.0, 0.0, response, ttft, response, 1, 0, 0,
                             decomposition=None, error=error)

    records = [rec(i, ttft=0.1 * (i + 1), per_token=0.01 * (i + 1)) for i in range(10)]
    records.append(rec(10, ttft=99.0, per_token=99.0, error="failed"))  # a failed request counts in neither
    t = totals(records)
    assert t.p50_ttft_s == pytest.approx(0.55) and t.p90_ttft_s == pytest.approx(0.91)
    assert t.p50_per_token_s == pytest.approx(0.055) and t.p90_per_token_s == pytest.approx(0.091)
    assert t.failed == 1 and t.mean_ttft_s == pytest.approx(0.55)
