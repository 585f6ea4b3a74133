"""Family adapters: how one model family names its weights and runs a span of its blocks.

We reuse the `transformers` decoder-layer modules (BloomBlock, LlamaDecoderLayer) and mask helpers, so the maths
is exactly the library's. Layers of a span are numbered locally (0..k-1): a per-span DynamicCache then reports
the right past length (transformers reads it from layer 0).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn
from transformers import BloomConfig, LlamaConfig, PretrainedConfig
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.models.bloom.modeling_bloom import BloomBlock, build_alibi_tensor
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding


@dataclass
class ClientModules:
    """What the client holds: token embeddings, the norms around the blocks, and the LM head."""

    embed: nn.Embedding
    embed_norm: nn.Module | None  # BLOOM normalises embeddings before block 0
    final_norm: nn.Module
    lm_head: nn.Linear


class FamilyAdapter(ABC):
    name: str
    config_class: type[PretrainedConfig]
    # candidate prefixes of the decoder stack in checkpoints (HF-saved vs original bigscience layout)
    stack_prefixes: tuple[str, ...]

    @abstractmethod
    def block_prefix(self) -> str:
        """Key of block i below the stack prefix, as a format string."""

    @abstractmethod
    def build_block(self, config: PretrainedConfig, local_idx: int) -> nn.Module:
        ...

    @abstractmethod
    def client_tensor_names(self, config: PretrainedConfig) -> dict[str, list[str]]:
        """Client module parameter -> candidate checkpoint keys (relative to the stack prefix or absolute)."""

    @abstractmethod
    def build_client(self, config: PretrainedConfig, tensors: dict[str, torch.Tensor]) -> ClientModules:
        ...

    @abstractmethod
    def forward_span(
        self,
        config: PretrainedConfig,
        blocks: nn.ModuleList,
        hidden: torch.Tensor,  # [B, T, H] new tokens only
        cache: DynamicCache,  # this span's cache, local layer indices
        attention_mask: torch.Tensor,  # [B, past + T] 1 = real token, 0 = padding
        extra: dict | None = None,
    ) -> torch.Tensor:
        ...

    def new_cache(self) -> DynamicCache:
        return DynamicCache()


def _causal_mask(config, hidden, attention_mask, cache, position_ids=None):
    # The library's own mask builder: the same mask (format, padding handling) as a local forward.
    return create_causal_mask(
        config=config, inputs_embeds=hidden, attention_mask=attention_mask, cache=cache, position_ids=position_ids
    )


class BloomAdapter(FamilyAdapter):
    name = "bloom"
    config_class = BloomConfig
    stack_prefixes = ("transformer.", "")

    def block_prefix(self) -> str:
        return "h.{}."

    def build_block(self, config, local_idx):
        return BloomBlock(config, layer_idx=local_idx)

    def client_tensor_names(self, config):
        return {
            "embed.weight": ["word_embeddings.weight"],
            "embed_norm.weight": ["word_embeddings_layernorm.weight"],
            "embed_norm.bias": ["word_embeddings_layernorm.bias"],
            "final_norm.weight": ["ln_f.weight"],
            "final_norm.bias": ["ln_f.bias"],
            # BLOOM ties the head to the embeddings: fall back to them when no separate head is stored
            "lm_head.weight": ["/lm_head.weight", "word_embeddings.weight"],
        }

    def build_client(self, config, tensors):
        h, eps = config.hidden_size, config.layer_norm_epsilon
        mods = ClientModules(
            embed=nn.Embedding(config.vocab_size, h, device="meta"),
            embed_norm=nn.LayerNorm(h, eps=eps, device="meta"),
            final_norm=nn.LayerNorm(h, eps=eps, device="meta"),
            lm_head=nn.Linear(h, config.vocab_size, bias=False, device="meta"),
        )
        return _assign(mods, tensors)

    def forward_span(self, config, blocks, hidden, cache, attention_mask, extra=None):
        alibi = build_alibi_tensor(attention_mask, config.n_head, dtype=hidden.dtype)
        mask = _causal_mask(config, hidden, attention_mask, cache)
        for block in blocks:
            hidden = block(hidden, alibi=alibi, attention_mask=mask, layer_past=cache, use_cache=True)[0]
        return hidden


class LlamaAdapter(FamilyAdapter):
    name = "llama"
    config_class = LlamaConfig
    stack_prefixes = ("model.",)

    def __init__(self) -> None:
        self._rotary: dict[int, LlamaRotaryEmbedding] = {}

    def block_prefix(self) -> str:
        return "layers.{}."

    def build_block(self, config, local_idx):
        return LlamaDecoderLayer(config, layer_idx=local_idx)

    def client_tensor_names(self, config):
        return {
            "embed.weight": ["embed_tokens.weight"],
            "final_norm.weight": ["norm.weight"],
            "lm_head.weight": ["/lm_head.weight", "embed_tokens.weight"]
            if config.tie_word_embeddings
            else ["/lm_head.weight"],
        }

    def build_client(self, config, tensors):
        h = config.hidden_size
        mods = ClientModules(
            embed=nn.Embedding(config.vocab_size, h, device="meta"),
            embed_norm=None,
            final_norm=LlamaRMSNorm(h, eps=config.rms_norm_eps).to("meta"),
            lm_head=nn.Linear(h, config.vocab_size, bias=False, device="meta"),
        )
        return _assign(mods, tensors)

    def rotary(self, config) -> LlamaRotaryEmbedding:
        key = id(config)
        if key not in self._rotary:  # inv_freq buffers are computed once per config, on CPU
            self._rotary[key] = LlamaRotaryEmbedding(config=config)
        return self._rotary[key]

    def forward_span(self, config, blocks, hidden, cache, attention_mask, extra=None):
        t = hidden.shape[1]
        # positions as transformers' generate() derives them from the padding mask
        positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)[:, -t:]
        mask = _causal_mask(config, hidden, attention_mask, cache, positions)
        cos_sin = self.rotary(config)(hidden, position_ids=positions)
        for block in blocks:
            hidden = block(
                hidden, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                position_embeddings=cos_sin,
            )
        return hidden


FAMILIES: dict[str, FamilyAdapter] = {"bloom": BloomAdapter(), "llama": LlamaAdapter()}


def family_for(config: PretrainedConfig) -> FamilyAdapter:
    try:
        return FAMILIES[config.model_type]
    except KeyError:
        raise ValueError(
            f"model type {config.model_type!r} is not supported; supported: {', '.join(FAMILIES)}"
        ) from None


def _assign(mods: ClientModules, tensors: dict[str, torch.Tensor]) -> ClientModules:
    for full_name, value in tensors.items():
        module_name, param = full_name.split(".", 1)
        module = getattr(mods, module_name)
        setattr(module, param, nn.Parameter(value, requires_grad=False))
    return mods
