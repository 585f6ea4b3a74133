"""Named model shapes. `tiny-*` for tests, `bloomz-560m` for the study, `llama-1b` for a modern family."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelPreset:
    name: str
    family: str  # "bloom" | "llama": which adapter in swarmlm.model.family
    config: dict[str, Any] = field(default_factory=dict)  # kwargs of the transformers config class
    tokenizer_vocab: int = 512  # BPE vocabulary trained for the checkpoint's tokenizer (<= vocab_size)


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in [
        ModelPreset(
            "tiny-bloom",
            "bloom",
            dict(vocab_size=512, hidden_size=64, n_layer=6, n_head=4),
        ),
        ModelPreset(
            "tiny-llama",
            "llama",
            dict(
                vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                tie_word_embeddings=False,
            ),
        ),
        # Between the two: compute dominates a step (profiles, benchmarks) yet it loads in a second.
        ModelPreset(
            "small-bloom",
            "bloom",
            dict(vocab_size=4096, hidden_size=512, n_layer=8, n_head=8),
            tokenizer_vocab=1024,
        ),
        # The real BLOOMZ-560M shapes: 24 blocks, d_model 1024, 16 heads, vocabulary 250,880.
        ModelPreset(
            "bloomz-560m",
            "bloom",
            dict(vocab_size=250880, hidden_size=1024, n_layer=24, n_head=16),
            tokenizer_vocab=4096,
        ),
        # Llama-3.2-1B shapes: 16 blocks, d_model 2048, GQA 32/8 heads, vocabulary 128,256.
        ModelPreset(
            "llama-1b",
            "llama",
            dict(
                vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                rope_theta=500000.0, tie_word_embeddings=True,
            ),
            tokenizer_vocab=4096,
        ),
    ]
}


def get_preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
