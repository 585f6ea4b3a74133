"""LoRA on a server's blocks without touching their weights: out += scale * (x @ a^T) @ b^T, added by forward hooks
that live for one forward. Used for a client's own LoRA (sent with a training request, server/training.py) and for
adapters the server pre-loads (server/adapters.py). Forwards run one at a time on the compute thread (or inline
while it is idle: server/scheduler.py), so no other request ever sees the hooks."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from swarmlm.model.packed import PackedLinear


@dataclass(frozen=True)
class LoraDelta:
    """LoRA on one linear layer of one block."""

    block: int  # global block index
    module: str  # the layer's name inside the block, e.g. "self_attn.q_proj"
    a: torch.Tensor  # [r, in_features]
    b: torch.Tensor  # [out_features, r]
    scale: float  # lora_alpha / r


def linear_layers(block: nn.Module) -> dict[str, nn.Module]:
    """A block's linear layers by name (what LoRA may target), packed ones included."""
    return {name: m for name, m in block.named_modules() if isinstance(m, (nn.Linear, PackedLinear))}


def _hook_for(delta: LoraDelta):
    def add_lora(module, inputs, output):
        x = inputs[0].to(delta.a.dtype)
        return output + (delta.scale * ((x @ delta.a.T) @ delta.b.T)).to(output.dtype)
    return add_lora


@contextlib.contextmanager
def lora_hooks(blocks: nn.ModuleList, first_block: int, deltas: Iterable[LoraDelta]):
    """Apply `deltas` within the block: blocks[i] is global block first_block + i."""
    handles = []
    try:
        for delta in deltas:
            layer = linear_layers(blocks[delta.block - first_block])[delta.module]
            handles.append(layer.register_forward_hook(_hook_for(delta)))
        yield
    finally:
        for handle in handles:
            handle.remove()
