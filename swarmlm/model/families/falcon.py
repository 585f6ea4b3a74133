"""Falcon with rotary embeddings: the 7B layout (multi-query, parallel attention + MLP) and the 40B/180B
"new decoder architecture" (grouped KV heads, one or two LayerNorms in parallel), all inside transformers'
FalconDecoderLayer. ALiBi Falcons (`alibi=True`, e.g. falcon-rw) are refused: their bias is folded into the mask
by FalconModel itself, which this adapter does not reproduce."""
from __future__ import annotations

import torch
from torch import nn
from transformers import FalconConfig
from transformers.masking_utils import create_causal_mask
from transformers.models.falcon.modeling_falcon import FalconDecoderLayer, FalconRotaryEmbedding

from swarmlm.model.families.base import ClientModules, FamilyAdapter, assign, padded_positions, register


@register
class FalconAdapter(FamilyAdapter):
    name = "falcon"
    config_class = FalconConfig
    stack_prefixes = ("transformer.",)

    def __init__(self) -> None:
        self._rotary: dict[int, FalconRotaryEmbedding] = {}

    def check(self, config):
        if config.alibi:
            raise ValueError("Falcon with alibi=True (e.g. falcon-rw) is not supported; rotary Falcons are")

    def block_prefix(self) -> str:
        return "h.{}."

    def make_layer(self, config, layer_idx):
        return FalconDecoderLayer(config, layer_idx=layer_idx)

    def client_tensor_names(self, config):
        tied = getattr(config, "tie_word_embeddings", True)
        return {
            "embed.weight": ["word_embeddings.weight"],
            "final_norm.weight": ["ln_f.weight"],
            "final_norm.bias": ["ln_f.bias"],
            "lm_head.weight": ["/lm_head.weight", "word_embeddings.weight"] if tied else ["/lm_head.weight"],
        }

    def build_client(self, config, tensors):
        h = config.hidden_size
        with torch.device("meta"):
            mods = ClientModules(
                embed=nn.Embedding(config.vocab_size, h),
                embed_norm=None,
                final_norm=nn.LayerNorm(h, eps=config.layer_norm_epsilon),
                lm_head=nn.Linear(h, config.vocab_size, bias=False),
            )
        return assign(mods, tensors)

    def kv_dim(self, config):
        # what FalconAttention caches: the new architecture expands its grouped KV heads to every query head before
        # the cache; otherwise num_kv_heads without multi-query, one head with it
        if config.new_decoder_architecture:
            heads = config.num_attention_heads
        else:
            heads = config.num_kv_heads if not config.multi_query else 1
        return int(heads * (config.hidden_size // config.num_attention_heads))

    def forward_span(self, config, blocks, hidden, cache, attention_mask, extra=None):
        positions = padded_positions(attention_mask, hidden.shape[1])
        # FalconModel always materialises the mask (its attention's is_causal shortcut then never applies)
        mask = create_causal_mask(
            config=config, inputs_embeds=hidden, attention_mask=attention_mask, cache=cache,
            position_ids=positions, allow_is_causal_skip=False,
        )
        key = id(config)
        if key not in self._rotary:
            self._rotary[key] = FalconRotaryEmbedding(config=config)
        cos_sin = self._rotary[key](hidden, position_ids=positions)
        for block in blocks:
            hidden = block(
                hidden, alibi=None, attention_mask=mask, position_ids=positions, layer_past=cache, use_cache=True,
                position_embeddings=cos_sin,
            )[0]
        return hidden
