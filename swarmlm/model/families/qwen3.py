"""Qwen3: RMSNorm on queries and keys inside attention, explicit head_dim; per-layer sliding windows."""
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding

from swarmlm.model.families.base import register
from swarmlm.model.families.rotary import RotaryFamily


@register
class Qwen3Adapter(RotaryFamily):
    name = "qwen3"
    config_class = Qwen3Config
    layer_class = Qwen3DecoderLayer
    rotary_class = Qwen3RotaryEmbedding
    norm_class = Qwen3RMSNorm
