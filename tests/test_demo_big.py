"""`swarmlm demo` on a preset's GGUF under memory budgets (cli/demo_big.py, issue 35): its plumbing on tiny-llama, the
path `swarmlm demo --preset llama-8b` takes (that preset does not fit here at float32)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


def _demo(home, *args: str, timeout_s: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(home), "COLUMNS": "200"}  # the file, profiles and reference cached in a tmp HOME
    return subprocess.run([sys.executable, "-m", "swarmlm.cli.main", "demo", *args], capture_output=True, text=True,
                          timeout=timeout_s, env=env)


@pytest.mark.slow
def test_a_preset_gguf_under_budgets_gives_the_references_tokens(tmp_path):
    done = _demo(tmp_path, "--preset", "tiny-llama", "--gguf", "q4_0", "--servers", "2", "--memory-mb", "280",
                 "--max-new-tokens", "6")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert (tmp_path / ".cache/swarmlm/gguf/tiny-llama-seed0.q4_0.gguf").is_file()
    rows = re.findall(r"│\s+(\S+) │\s+(\d+:\d+) │\s+(\d+) │\s+(\d+) │\s+(\d+) │\s+(\d+) │", out)
    assert [(blocks, budget) for _, blocks, budget, *_ in rows] == [("0:3", "280"), ("3:6", "280")], out
    assert all(int(own) > 0 for *_, own, _ in rows), out  # each server's memory, read from /proc
    assert re.search(r"route \(server id suffix\[blocks\]\): \S+\[0:3\) -> \S+\[3:6\)", out), out
    assert re.search(r"decode: [\d.]+ tokens/s", out), out
    assert "same tokens as the reference: yes" in out, out


def test_gguf_without_a_preset_is_one_line(tmp_path):
    done = _demo(tmp_path, "--gguf", "q4_0", timeout_s=300)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == ["swarmlm demo: --gguf goes with --preset (a catalog model or a file is "
                                                "served as it is)"], done.stderr
