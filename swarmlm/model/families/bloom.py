"""BLOOM: ALiBi position biases from the padding mask, LayerNorm on embeddings, eager attention with a float
mask (what transformers runs for BLOOM)."""
from __future__ import annotations

import torch
from torch import nn
from transformers import BloomConfig
from transformers.masking_utils import create_causal_mask
from transformers.models.bloom.modeling_bloom import BloomBlock, build_alibi_tensor

from swarmlm.model.families.base import ClientModules, FamilyAdapter, assign, register


@register
class BloomAdapter(FamilyAdapter):
    name = "bloom"
    config_class = BloomConfig
    stack_prefixes = ("transformer.", "")  # HF-saved vs original bigscience layout
    attn_implementation = "eager"

    def block_prefix(self) -> str:
        return "h.{}."

    def make_layer(self, config, layer_idx):
        return BloomBlock(config, layer_idx=layer_idx)

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
        with torch.device("meta"):
            mods = ClientModules(
                embed=nn.Embedding(config.vocab_size, h),
                embed_norm=nn.LayerNorm(h, eps=eps),
                final_norm=nn.LayerNorm(h, eps=eps),
                lm_head=nn.Linear(h, config.vocab_size, bias=False),
            )
        return assign(mods, tensors)

    def kv_dim(self, config):
        return int(config.hidden_size)

    def forward_span(self, config, blocks, hidden, cache, attention_mask, extra=None):
        alibi = build_alibi_tensor(attention_mask, config.n_head, dtype=hidden.dtype)
        mask = create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=attention_mask, cache=cache)
        for block in blocks:
            hidden = block(hidden, alibi=alibi, attention_mask=mask, layer_past=cache, use_cache=True)[0]
        return hidden
