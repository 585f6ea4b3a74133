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

from swarmlm.model.tuned import block_linears, read_settings, tensor_shapes
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
    if str(ref).startswith((".", "/", "~")) or path.exists():
        raise FileNotFoundError(f"adapter {ref}: no such directory (a LoRA folder: adapter_config.json + "
                                "adapter_model.safetensors)")
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


def check_adapters(refs, model_dir: str) -> list[str]:
    """Every adapter of `server --adapters` found, a LoRA, and of this model's block count, layer names and shapes:
    checked on the files' headers and the blocks' shapes (meta device) before any weight loads. Its names."""
    from swarmlm.model.checkpoint import load_config
    from swarmlm.model.families import family_for

    if len(refs) > MAX_ADAPTERS:
        raise ValueError(f"at most {MAX_ADAPTERS} adapters, got {len(refs)}")
    config = load_config(model_dir)
    family, blocks = family_for(config), int(config.num_hidden_layers)
    names = []
    for ref in refs:
        name, directory = locate_adapter(ref)
        settings = read_settings(directory)
        if settings.mode != "lora":
            raise ValueError(f"adapter {ref}: a soft prompt ({settings.mode}) is the client's to prepend "
                             f"(swarmlm chat/generate --adapter {ref}); servers pre-load LoRA adapters only")
        linears: dict[int, dict[str, nn.Module]] = {}
        for key, shape in tensor_shapes(directory).items():
            found = _KEY.search(key)
            if found is None or int(found[1]) >= blocks:
                raise ValueError(f"adapter {ref}: {key} is not a LoRA matrix of one of this model's {blocks} blocks "
                                 f"(tuned on {settings.base_model or 'another model'}?)")
            block, module, which = int(found[1]), found[2], found[3]
            layer = linears.setdefault(block, block_linears(family, config, block)).get(module)
            r = settings.lora_r
            want = None if layer is None else (r, layer.in_features) if which == "A" else (layer.out_features, r)
            if want != shape:
                raise ValueError(f"adapter {ref}: block {block} {module}.lora_{which} is {list(shape)}, this model's "
                                 f"layer needs {list(want) if want else 'a linear layer of that name'} (tuned on "
                                 f"{settings.base_model or 'another model'}?)")
        if name in names:
            raise ValueError(f"two adapters are named {name!r}: rename one's directory")
        names.append(name)
    return names


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
