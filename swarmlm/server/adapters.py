"""LoRA adapters a server pre-loads (`swarmlm server --adapters DIR_OR_HUB_ID ...`, PEFT's format: adapter_config.json +
adapter_model.safetensors), announced in its record; a session opened with `adapter=NAME` runs with it (inference,
as Petals' active_adapter). The base weights never change: the adapter is applied by forward hooks per forward
(server/lora.py), and steps of sessions with different adapters never share a forward (their batch keys differ)."""
from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from swarmlm.server.lora import LoraDelta, linear_layers
from swarmlm.types import BlockRange

NAME = re.compile(r"^[A-Za-z0-9._\-]{1,64}$")  # an adapter's name: its directory's name
MAX_ADAPTERS = 16  # announced in the record: a short list
# PEFT's key for a block's LoRA matrix: ...layers.{i}.<module>.lora_A.weight (Llama-style) or ...h.{i}.<module>...
_KEY = re.compile(r"\.(?:layers|h)\.(\d+)\.(.+)\.lora_([AB])(?:\.default)?\.weight$")


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def locate_adapter(ref: str | Path) -> tuple[str, Path]:
    """An adapter's name and the directory of its files: a directory (named by it), or a hub id `org/name[@rev]`
    from the local HF cache (or the hub, when reachable), named `name`, as models are found (model/source.py)."""
    from swarmlm.model.source import ModelNotFound, resolve

    path = Path(ref).expanduser()
    if path.is_dir():
        return adapter_name(path), path
    source = resolve(str(ref))
    if not source.is_hub:
        raise ModelNotFound(f"{ref}: an adapter is a directory or a hub id, not a model of the catalog or a GGUF")
    directory = source.file(ADAPTER_FILES[0]).parent
    source.file(ADAPTER_FILES[1])  # both present (the cache keeps one snapshot directory per revision)
    return adapter_name(source.repo_id.split("/")[-1]), directory


def adapter_name(path: str | Path) -> str:
    name = Path(path).name
    if not NAME.match(name):
        raise ValueError(f"adapter directory name {name!r}: use letters, digits, '.', '_' or '-' (at most 64)")
    return name


def adapter_fingerprint(path: str | Path) -> str:
    """16 hex characters of SHA-256 over an adapter's rank, alpha and scaling rule and every matrix (name, dtype,
    shape, bytes; all blocks', so servers of other ranges announce the same): announced with its name as
    `name@fingerprint`, two adapters of one name but other weights are told apart (issue 39, hole 7)."""
    path = Path(path)
    config = json.loads((path / "adapter_config.json").read_text())
    digest = hashlib.sha256(json.dumps([config.get("r"), config.get("lora_alpha"), bool(config.get("use_rslora"))])
                            .encode())
    for key, value in sorted(load_file(str(path / "adapter_model.safetensors")).items()):
        digest.update(f"{key}|{value.dtype}|{list(value.shape)}|".encode())
        digest.update(value.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def load_adapter(path: str | Path, blocks: nn.ModuleList, served: BlockRange) -> tuple[LoraDelta, ...]:
    """A PEFT LoRA adapter's matrices for the served blocks (others are left to the servers holding them)."""
    path = Path(path)
    config = json.loads((path / "adapter_config.json").read_text())
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora") or config.get("fan_in_fan_out"):
        raise ValueError(f"{path}: only plain LoRA adapters are served (peft_type LORA, no DoRA, no fan_in_fan_out)")
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    pairs: dict[tuple[int, str], dict[str, object]] = {}
    for key, value in load_file(str(path / "adapter_model.safetensors")).items():
        found = _KEY.search(key)
        if found is None:
            raise ValueError(f"{path}: {key} is not a LoRA matrix of a block (modules_to_save etc. are not served)")
        block, module, which = int(found[1]), found[2], found[3]
        pairs.setdefault((block, module), {})[which] = value.float()
    deltas = []
    for (block, module), ab in sorted(pairs.items()):
        if not served.start <= block < served.end:
            continue
        layer = linear_layers(blocks[block - served.start]).get(module)
        a, b = ab.get("A"), ab.get("B")
        if layer is None or a is None or b is None or a.shape != (r, layer.in_features) \
                or b.shape != (layer.out_features, r):
            raise ValueError(f"{path}: block {block} {module}: no such linear layer, or matrices of other shapes")
        deltas.append(LoraDelta(block, module, a, b, scale))
    return tuple(deltas)
