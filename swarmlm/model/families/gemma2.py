"""Gemma 2: alternating sliding-window / global layers (config.layer_types), attention-logit softcapping inside
the layer (eager attention: SDPA cannot softcap, transformers picks eager too), embeddings scaled by
sqrt(hidden_size) and the final logits softcapped on the client. RMSNorm is (1 + weight)."""
from __future__ import annotations

import torch
from torch import nn
from transformers import Gemma2Config
from transformers.models.gemma2.modeling_gemma2 import (
    Gemma2DecoderLayer,
    Gemma2RMSNorm,
    Gemma2RotaryEmbedding,
    Gemma2TextScaledWordEmbedding,
)

from swarmlm.model.families.base import register
from swarmlm.model.families.rotary import RotaryFamily


class SoftcappedHead(nn.Linear):
    """LM head + Gemma 2's final logit softcapping, the same three operations as Gemma2ForCausalLM."""

    def __init__(self, hidden: int, vocab: int, softcap: float | None) -> None:
        super().__init__(hidden, vocab, bias=False)
        self.softcap = softcap

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().forward(hidden)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


@register
class Gemma2Adapter(RotaryFamily):
    name = "gemma2"
    config_class = Gemma2Config
    layer_class = Gemma2DecoderLayer
    rotary_class = Gemma2RotaryEmbedding
    norm_class = Gemma2RMSNorm
    attn_implementation = "eager"

    def make_embedding(self, config):
        embed = Gemma2TextScaledWordEmbedding(
            config.vocab_size, config.hidden_size, config.pad_token_id, embed_scale=config.hidden_size**0.5
        )
        # a non-persistent buffer: not in the checkpoint, so set it here (built on meta with the module)
        embed.embed_scale = torch.tensor(config.hidden_size**0.5, device="cpu")
        return embed

    def make_head(self, config):
        return SoftcappedHead(config.hidden_size, config.vocab_size, config.final_logit_softcapping)
