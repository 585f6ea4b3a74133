"""`swarmlm simulate` end to end on a small generated topology."""
from __future__ import annotations

import csv
import json

from swarmlm.cli.main import main
from swarmlm.sim.generators import ClusterSpec, clustered_topology, write_topology


def _topology(tmp_path):
    doc = clustered_topology([ClusterSpec("cpu", clients=1), ClusterSpec("gpu", a100=2, clients=1),
                              ClusterSpec("mig", mig=7, clients=1)], 20, 16, arrival_rate=0.5)
    return str(write_topology(doc, tmp_path / "topo.json"))


def test_simulate_json_and_out_dir(tmp_path, capsys):
    topo = _topology(tmp_path)
    out = tmp_path / "out"
    rc = main(["simulate", "--topology", topo, "--algorithm", "cg-bprr", "--routing", "waiting-aware",
               "--requests", "40", "--seed", "3", "--json", "--out", str(out)])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    for key in ("requests", "mean_per_token_s", "mean_ttft_s", "mean_wait_s", "p90_per_token_s"):
        assert key in summary
    assert summary["requests"] == 40 and summary["completed"] == 40
    assert summary["mean_ttft_s"] > 0 and summary["p90_per_token_s"] >= summary["p50_per_token_s"]
    rows = list(csv.DictReader((out / "requests.csv").open()))
    assert len(rows) == 40 and {"arrival_s", "wait_s", "ttft_s", "per_token_s", "finish_s"} <= set(rows[0])
    assert (out / "servers.csv").exists() and (out / "latency_cdf.png").stat().st_size > 1000
    assert (out / "servers.png").exists()
    assert json.loads((out / "summary.json").read_text())["requests"] == 40
    # same seed, same numbers
    assert main(["simulate", "--topology", topo, "--algorithm", "cg-bprr", "--routing", "waiting-aware",
                 "--requests", "40", "--seed", "3", "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["mean_per_token_s"] == summary["mean_per_token_s"]


def test_simulate_duration_petals_table_and_errors(tmp_path, capsys):
    topo = _topology(tmp_path)
    assert main(["simulate", "--topology", topo, "--algorithm", "petals", "--duration", "30"]) == 0
    assert "per-token time" in capsys.readouterr().out
    assert main(["simulate", "--topology", str(tmp_path / "missing.json"), "--algorithm", "petals"]) == 2
    assert "error" in capsys.readouterr().err
    assert main(["simulate", "--topology", topo, "--requests", "0"]) == 2
    capsys.readouterr()
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s,input_tokens,output_tokens\n0,20,4\n1.5,20,8\n")
    assert main(["simulate", "--topology", topo, "--trace", str(trace), "--wait", "queue", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["requests"] == 2 and summary["completed"] == 2
