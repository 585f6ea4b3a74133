"""Checkpoints laid out as the Hugging Face cache holds them (no hub on this machine):
`<cache>/models--org--name/{blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/<sha256>, refs/main}`."""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def add_to_hub_cache(cache: Path, repo_id: str, checkpoint: str | Path, commit: str | None = None) -> Path:
    """Copy a checkpoint directory into the cache as repo `repo_id` at `commit` (refs/main points to it); returns
    the snapshot directory."""
    repo = Path(cache) / f"models--{repo_id.replace('/', '--')}"
    commit = commit or hashlib.sha1(repo_id.encode()).hexdigest()  # 40 hex digits, like a git commit
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for src in sorted(Path(checkpoint).iterdir()):
        if not src.is_file():
            continue
        digest = hashlib.sha256(src.read_bytes()).hexdigest()
        blob = repo / "blobs" / digest
        if not blob.exists():
            shutil.copyfile(src, blob)
        link = snapshot / src.name
        if not link.exists():
            os.symlink(os.path.relpath(blob, snapshot), link)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot
