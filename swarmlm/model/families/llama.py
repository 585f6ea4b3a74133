"""Llama 1-3 (RMSNorm, RoPE incl. Llama-3 `rope_parameters` scaling, grouped-query attention)."""
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from swarmlm.model.families.base import register
from swarmlm.model.families.rotary import RotaryFamily


@register
class LlamaAdapter(RotaryFamily):
    name = "llama"
    config_class = LlamaConfig
    layer_class = LlamaDecoderLayer
    rotary_class = LlamaRotaryEmbedding
    norm_class = LlamaRMSNorm
