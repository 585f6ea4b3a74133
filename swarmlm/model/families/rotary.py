"""The shape most modern families share (Llama, Mistral, Qwen, Mixtral, Gemma 2): `model.layers.{i}` decoder
layers called with rotary position embeddings, a causal or sliding-window mask per layer type, an RMSNorm before
the head. A family built on it names its transformers classes and overrides only what differs."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from swarmlm.model.families.base import FULL, SLIDING, ClientModules, FamilyAdapter, assign, padded_positions

MASK_BUILDERS: dict[str, Callable] = {FULL: create_causal_mask, SLIDING: create_sliding_window_causal_mask}


class RotaryFamily(FamilyAdapter):
    layer_class: type[nn.Module]  # e.g. LlamaDecoderLayer
    rotary_class: type[nn.Module]  # e.g. LlamaRotaryEmbedding (reads rope_parameters: Llama-3 scaling, YaRN...)
    norm_class: type[nn.Module]  # the final norm, e.g. LlamaRMSNorm
    stack_prefixes = ("model.",)

    def __init__(self) -> None:
        self._rotary: dict[int, nn.Module] = {}

    def block_prefix(self) -> str:
        return "layers.{}."

    def make_layer(self, config, layer_idx):
        return self.layer_class(config, layer_idx=layer_idx)

    def client_tensor_names(self, config):
        tied = getattr(config, "tie_word_embeddings", False)
        return {
            "embed.weight": ["embed_tokens.weight"],
            "final_norm.weight": ["norm.weight"],
            "lm_head.weight": ["/lm_head.weight", "embed_tokens.weight"] if tied else ["/lm_head.weight"],
        }

    def build_client(self, config, tensors):
        h = config.hidden_size
        with torch.device("meta"):  # weights come from the checkpoint: no random init
            mods = ClientModules(
                embed=self.make_embedding(config),
                embed_norm=None,
                final_norm=self.norm_class(h, eps=config.rms_norm_eps),
                lm_head=self.make_head(config),
            )
        return assign(mods, tensors)

    def make_embedding(self, config) -> nn.Module:
        return nn.Embedding(config.vocab_size, config.hidden_size)

    def make_head(self, config) -> nn.Module:
        return nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def rotary(self, config) -> nn.Module:
        key = id(config)
        if key not in self._rotary:  # inv_freq buffers are computed once per config, on CPU
            self._rotary[key] = self.rotary_class(config=config)
        return self._rotary[key]

    def masks(self, config, blocks, hidden, cache, attention_mask, positions) -> dict[str, torch.Tensor | None]:
        """One mask per layer type present in the span, built by transformers' own builders."""
        kinds = {block.swarmlm_layer_type for block in blocks}
        return {
            kind: MASK_BUILDERS[kind](
                config=config, inputs_embeds=hidden, attention_mask=attention_mask, cache=cache,
                position_ids=positions,
            )
            for kind in kinds
        }

    def forward_span(self, config, blocks, hidden, cache, attention_mask, extra=None):
        positions = padded_positions(attention_mask, hidden.shape[1])  # [B, T]
        masks = self.masks(config, blocks, hidden, cache, attention_mask, positions)
        cos_sin = self.rotary(config)(hidden, position_ids=positions)
        for block in blocks:
            hidden = block(
                hidden, attention_mask=masks[block.swarmlm_layer_type], position_ids=positions, cache=cache,
                use_cache=True, position_embeddings=cos_sin,
            )
        return hidden


class SlidingEverywhereFamily(RotaryFamily):
    """Mistral-style: one `sliding_window` (or None) for every layer, no `layer_types`."""

    def layer_type(self, config: PretrainedConfig, layer_idx: int) -> str:
        return SLIDING if getattr(config, "sliding_window", None) else FULL
