"""This repository's files at a git revision, in a temporary directory: what an A/B benchmark runs as its base
(hop_breakdown.py --ab, server_step_cost.py --ab, split_decode.py --server-base)."""
from __future__ import annotations

import contextlib
import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def source_tree(revision: str):
    """A temporary directory holding the repository's files at `revision` (git archive), removed after."""
    with tempfile.TemporaryDirectory(prefix="swarmlm-base-") as tree:
        archive = subprocess.run(["git", "archive", revision], cwd=REPO, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
        yield tree
