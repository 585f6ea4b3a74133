"""The references a hop is measured against (docs/RESULTS-hop.md rounds 14, 18): the bare C floors
(benchmarks/hop_floor.py, chain_floor.py) run and report a median or a ratio per setting; llama.cpp's side
(benchmarks/llamacpp_hop.py) refuses a converter that is not there with one clear error. No time is asserted."""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build hop_floor.c")
def test_hop_floor_reports_a_median_per_setting():
    out = subprocess.run([sys.executable, str(BENCHMARKS / "hop_floor.py"), "--values", "64", "--compute", "none",
                          "sleep:1", "--rounds", "1", "--round-trips", "4"],
                         check=True, capture_output=True, text=True, timeout=60).stdout
    assert "64 float32 = 256 bytes" in out
    for setting in ("none", r"sleep 1 ms"):
        row = re.search(rf"^{setting} +([0-9.]+) +([0-9.]+)$", out, re.M)
        assert row, out
        median, p90 = float(row[1]), float(row[2])
        assert 0 < median <= p90  # microseconds of a real round trip, past the server's compute


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build chain_floor.c")
def test_chain_floor_reports_each_setting_against_one_server():
    out = subprocess.run([sys.executable, str(BENCHMARKS / "chain_floor.py"), "--compute-ms", "0.3", "--head-ms",
                          "0.1", "--tokens", "5", "--rounds", "1"],
                         check=True, capture_output=True, text=True, timeout=120).stdout
    rows = dict(re.findall(r"^\| (1 server|3 relayed|3 pushed \+ middle replies|3 pushed) \| [0-9.]+ \| [0-9.]+ \| "
                           r"([0-9.]+)x \|$", out, re.M))
    assert set(rows) == {"1 server", "3 relayed", "3 pushed + middle replies", "3 pushed"}, out
    assert rows["1 server"] == "1.000" and all(float(ratio) > 0 for ratio in rows.values())


def test_hop_floor_refuses_an_unknown_compute_setting():
    hop_floor = _module("hop_floor")
    assert hop_floor.parse_compute("stream:17") == hop_floor.Setting("stream", 17.0)
    for bad in ("spin:5", "sleep", "none:3", "sleep:-1"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            hop_floor.parse_compute(bad)


def test_gguf_conversion_refuses_a_missing_converter(tmp_path):
    llamacpp_hop = _module("llamacpp_hop")
    missing = tmp_path / "llama.cpp" / "convert_hf_to_gguf.py"
    with pytest.raises(FileNotFoundError, match="convert_hf_to_gguf.py does not exist"):
        llamacpp_hop.gguf_f32(tmp_path, missing)
    assert not (tmp_path / llamacpp_hop.GGUF_NAME).exists()
    assert llamacpp_hop.converter_of(tmp_path / "build" / "bin") == tmp_path.resolve() / "convert_hf_to_gguf.py"


def test_span_split_reports_one_span_beside_n(tmp_path):
    """benchmarks/span_split.py (what splitting costs the compute alone, in one process) runs on a packed GGUF and
    reports both setups' per-token CPU time."""
    from swarmlm.model.random_checkpoint import init_gguf

    model = init_gguf("tiny-llama", tmp_path / "tiny.q4_0.gguf", "q4_0", seed=5)
    out = subprocess.run([sys.executable, str(BENCHMARKS / "span_split.py"), "--model", str(model), "--spans", "2",
                          "--rounds", "1", "--tokens", "2"],
                         check=True, capture_output=True, text=True, timeout=120, cwd=BENCHMARKS).stdout
    row = re.search(r"1 span ([0-9.]+) ms, 2 spans ([0-9.]+) ms", out)
    assert row, out
    assert float(row[1]) > 0 and float(row[2]) > 0
