"""Qwen2: biased q/k/v projections; sliding windows on the layers `config.layer_types` names."""
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm, Qwen2RotaryEmbedding

from swarmlm.model.families.base import register
from swarmlm.model.families.rotary import RotaryFamily


@register
class Qwen2Adapter(RotaryFamily):
    name = "qwen2"
    config_class = Qwen2Config
    layer_class = Qwen2DecoderLayer
    rotary_class = Qwen2RotaryEmbedding
    norm_class = Qwen2RMSNorm
