"""Local Hugging Face checkpoints (`config.json` + `*.safetensors`, sharded or not).

A server reads only the tensors of its block range, a client only embeddings, norms and head: nothing else of
the model is ever materialised.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from swarmlm.model.family import ClientModules, FamilyAdapter, family_for

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}") from None


def load_config(model_dir: str | Path) -> PretrainedConfig:
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json: not a checkpoint directory")
    config = AutoConfig.from_pretrained(model_dir)
    # The mask format must be the one the block modules expect: BLOOM adds a float mask (eager), Llama runs SDPA.
    config._attn_implementation = "eager" if config.model_type == "bloom" else "sdpa"
    return config


def num_blocks(config: PretrainedConfig) -> int:
    return int(config.num_hidden_layers)


class TensorIndex:
    """Which safetensors file holds which tensor; reads single tensors without loading whole files."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        index = self.model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {k: self.model_dir / v for k, v in weight_map.items()}
        else:
            single = self.model_dir / "model.safetensors"
            if not single.is_file():
                raise FileNotFoundError(f"{self.model_dir} has neither model.safetensors nor its index")
            with safe_open(single, framework="pt") as f:
                self.files = {k: single for k in f.keys()}

    def find(self, candidates: list[str]) -> str | None:
        return next((c for c in candidates if c in self.files), None)

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        by_file: dict[Path, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.files[key], []).append(key)
        out: dict[str, torch.Tensor] = {}
        for path, names in by_file.items():
            with safe_open(path, framework="pt") as f:
                for name in names:
                    out[name] = f.get_tensor(name)
        return out

    def stack_prefix(self, adapter: FamilyAdapter) -> str:
        for prefix in adapter.stack_prefixes:
            probe = prefix + adapter.block_prefix().format(0)
            if any(k.startswith(probe) for k in self.files):
                return prefix
        raise ValueError(f"{self.model_dir}: no tensors of block 0 under {adapter.stack_prefixes}")


def load_blocks(
    model_dir: str | Path, start: int, end: int, dtype: torch.dtype = torch.float32
) -> tuple[PretrainedConfig, FamilyAdapter, nn.ModuleList]:
    """Blocks [start, end) of the checkpoint, numbered locally 0..end-start-1."""
    config = load_config(model_dir)
    if not 0 <= start < end <= num_blocks(config):
        raise ValueError(f"blocks [{start}, {end}) outside the model's [0, {num_blocks(config)})")
    adapter = family_for(config)
    index = TensorIndex(model_dir)
    prefix = index.stack_prefix(adapter)
    blocks = nn.ModuleList()
    for local, global_idx in enumerate(range(start, end)):
        block_prefix = prefix + adapter.block_prefix().format(global_idx)
        keys = [k for k in index.files if k.startswith(block_prefix)]
        tensors = index.read(keys)
        with torch.device("meta"):  # no random init of weights we are about to replace
            block = adapter.build_block(config, local)
        state = {k[len(block_prefix):]: v.to(dtype) for k, v in tensors.items()}
        block.load_state_dict(state, strict=True, assign=True)
        blocks.append(block.eval().requires_grad_(False))
    return config, adapter, blocks


def load_client_modules(
    model_dir: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[PretrainedConfig, FamilyAdapter, ClientModules]:
    config = load_config(model_dir)
    adapter = family_for(config)
    index = TensorIndex(model_dir)
    prefix = index.stack_prefix(adapter)
    wanted: dict[str, str] = {}
    for name, candidates in adapter.client_tensor_names(config).items():
        full = [c[1:] if c.startswith("/") else prefix + c for c in candidates]
        found = index.find(full)
        if found is None:
            raise ValueError(f"{model_dir}: none of {full} found for {name}")
        wanted[name] = found
    tensors = index.read(sorted(set(wanted.values())))
    return config, adapter, adapter.build_client(config, {n: tensors[k].to(dtype) for n, k in wanted.items()})
