"""Mixtral: Mistral's attention with a sparse mixture-of-experts MLP (transformers' own MixtralSparseMoeBlock).

Checkpoints store each expert separately (`block_sparse_moe.experts.{e}.w1/w2/w3.weight`, the hub layout, also
what `save_pretrained` writes); transformers 5's layer holds them fused (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]). `convert_block_state` does the same merge transformers' loader does
(conversion_mapping "mixtral": stack w1 and w3 per expert, concatenate along dim 1; stack w2)."""
from __future__ import annotations

import re

import torch
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer, MixtralRMSNorm, MixtralRotaryEmbedding

from swarmlm.model.families.base import register
from swarmlm.model.families.rotary import SlidingEverywhereFamily

_EXPERT = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")


@register
class MixtralAdapter(SlidingEverywhereFamily):
    name = "mixtral"
    config_class = MixtralConfig
    layer_class = MixtralDecoderLayer
    rotary_class = MixtralRotaryEmbedding
    norm_class = MixtralRMSNorm

    def configure(self, config):
        super().configure(config)
        config._experts_implementation = "grouped_mm"  # what AutoModelForCausalLM picks on CPU

    def convert_block_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        experts: dict[str, dict[int, torch.Tensor]] = {"w1": {}, "w2": {}, "w3": {}}
        out: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            if m := _EXPERT.match(key):
                experts[m.group(2)][int(m.group(1))] = value
            else:  # already in the fused layout, or not an expert tensor
                out[key.replace("block_sparse_moe.", "mlp.", 1)] = value
        if experts["w1"]:
            n = len(experts["w1"])
            if any(sorted(experts[w]) != list(range(n)) for w in experts):
                raise ValueError(f"Mixtral block: experts' w1/w2/w3 tensors are incomplete ({n} experts)")
            stack = lambda w: torch.stack([experts[w][e] for e in range(n)])  # noqa: E731
            out["mlp.experts.gate_up_proj"] = torch.cat([stack("w1"), stack("w3")], dim=1)  # [E, 2I, H]
            out["mlp.experts.down_proj"] = stack("w2")  # [E, H, I]
        return out
