"""What a model family must tell swarmlm, and the registry of families.

A family adapter names its checkpoint tensors, builds one of transformers' own decoder layers for a block, builds
the client's modules (embeddings, final norm, LM head) and runs a span of blocks over a session's cache with the
library's own rotary embeddings and mask builders, so the maths is exactly transformers'.

Blocks are built with their *global* index (so per-layer settings such as Gemma 2's alternating sliding windows
come from the right entry of `config.layer_types`) and then renumbered for the cache: a span's layers use cache
indices 0..k-1, so a per-span cache reports the right past length (transformers reads it from layer 0).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.cache_utils import Cache

FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' names in config.layer_types


@dataclass
class ClientModules:
    """What the client holds: token embeddings, the norms around the blocks, and the LM head.

    Family specifics live inside these modules, so a caller only chains them:
    logits = lm_head(final_norm(blocks(embed_norm(embed(ids))))) (e.g. Gemma 2's embedding scale is in `embed`,
    its final logit softcapping in `lm_head`)."""

    embed: nn.Module
    embed_norm: nn.Module | None  # BLOOM normalises embeddings before block 0
    final_norm: nn.Module
    lm_head: nn.Module


class FamilyAdapter(ABC):
    name: str  # config.model_type
    config_class: type[PretrainedConfig]
    stack_prefixes: tuple[str, ...]  # candidate prefixes of the decoder stack in checkpoints
    attn_implementation: str = "sdpa"  # what transformers' AutoModel picks for this family on CPU

    def check(self, config: PretrainedConfig) -> None:
        """Raise ValueError for a variant of the family this adapter does not run."""

    def configure(self, config: PretrainedConfig) -> None:
        """Set the kernels the layers dispatch to, as transformers' AutoModel would on this machine."""
        config._attn_implementation = self.attn_implementation

    @abstractmethod
    def block_prefix(self) -> str:
        """Key of block i below the stack prefix, as a format string."""

    @abstractmethod
    def make_layer(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        """transformers' decoder layer for global block `layer_idx`."""

    def build_block(self, config: PretrainedConfig, layer_idx: int, cache_idx: int | None = None) -> nn.Module:
        """Block `layer_idx` of the model, writing its K/V to cache layer `cache_idx` (default: layer_idx)."""
        block = self.make_layer(config, layer_idx)
        block.swarmlm_layer_type = self.layer_type(config, layer_idx)
        if cache_idx is not None:
            for module in block.modules():  # layer_idx only picks the cache layer once the module is built
                if hasattr(module, "layer_idx"):
                    module.layer_idx = cache_idx
        return block

    def layer_type(self, config: PretrainedConfig, layer_idx: int) -> str:
        """"full_attention" or "sliding_attention" for block `layer_idx`."""
        types = getattr(config, "layer_types", None)
        return types[layer_idx] if types else FULL

    def convert_block_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint tensors of one block (keys relative to the block) -> the layer's state dict."""
        return state

    @abstractmethod
    def client_tensor_names(self, config: PretrainedConfig) -> dict[str, list[str]]:
        """Client module parameter -> candidate checkpoint keys (relative to the stack prefix, or absolute with a
        leading "/")."""

    @abstractmethod
    def build_client(self, config: PretrainedConfig, tensors: dict[str, torch.Tensor]) -> ClientModules:
        ...

    @abstractmethod
    def forward_span(
        self,
        config: PretrainedConfig,
        blocks: nn.ModuleList,
        hidden: torch.Tensor,  # [B, T, H] new tokens only
        cache: Cache,  # this span's cache, local layer indices
        attention_mask: torch.Tensor,  # [B, past + T] 1 = real token, 0 = padding
        extra: dict | None = None,
    ) -> torch.Tensor:
        ...

    def kv_dim(self, config: PretrainedConfig) -> int:
        """Width of one block's key (or value) per token."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return int((getattr(config, "num_key_value_heads", None) or heads) * head_dim)


FAMILIES: dict[str, FamilyAdapter] = {}


def register(cls: type[FamilyAdapter]) -> type[FamilyAdapter]:
    """Class decorator: one instance per family, keyed by config.model_type."""
    FAMILIES[cls.name] = cls()
    return cls


def family_for(config: PretrainedConfig) -> FamilyAdapter:
    try:
        adapter = FAMILIES[config.model_type]
    except KeyError:
        raise ValueError(
            f"model type {config.model_type!r} is not supported; supported: {', '.join(sorted(FAMILIES))}"
        ) from None
    adapter.check(config)
    return adapter


def assign(mods: ClientModules, tensors: dict[str, torch.Tensor]) -> ClientModules:
    """Put checkpoint tensors into modules built on the meta device ("embed.weight" -> mods.embed.weight)."""
    for full_name, value in tensors.items():
        module_name, param = full_name.split(".", 1)
        module = getattr(mods, module_name)
        setattr(module, param, nn.Parameter(value, requires_grad=False))
    return mods


def padded_positions(attention_mask: torch.Tensor, t: int) -> torch.Tensor:
    """Positions of the last t tokens as transformers' generate() derives them from a left-padding mask: [B, t]."""
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)[:, -t:]
