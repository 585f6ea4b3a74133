"""Mistral: Llama's layer plus an optional sliding window over every layer."""
from transformers import MistralConfig
from transformers.models.mistral.modeling_mistral import MistralDecoderLayer, MistralRMSNorm, MistralRotaryEmbedding

from swarmlm.model.families.base import register
from swarmlm.model.families.rotary import SlidingEverywhereFamily


@register
class MistralAdapter(SlidingEverywhereFamily):
    name = "mistral"
    config_class = MistralConfig
    layer_class = MistralDecoderLayer
    rotary_class = MistralRotaryEmbedding
    norm_class = MistralRMSNorm
