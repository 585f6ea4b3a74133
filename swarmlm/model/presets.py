"""Named model shapes. `tiny-*` for tests (one per family, each exercising what makes its family different:
sliding windows, Llama-3 rope scaling, experts, softcapping...), `bloomz-560m` for the study, `llama-1b` for a
modern family."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelPreset:
    name: str
    family: str  # config.model_type: which adapter in swarmlm.model.families
    config: dict[str, Any] = field(default_factory=dict)  # kwargs of the transformers config class
    tokenizer_vocab: int = 512  # BPE vocabulary trained for the checkpoint's tokenizer (<= vocab_size)
    # Llama-3 style: no pad token, several end-of-sequence ids (the tokenizer's </s> and <pad>)
    llama3_tokens: bool = False


_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False)


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
        # Llama-3.x: "llama3" rope scaling (transformers 5's rope_parameters), no pad id, two eos ids.
        ModelPreset(
            "tiny-llama3",
            "llama",
            dict(_TINY, rope_parameters=dict(
                rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=64,  # small, so test prompts reach the scaled frequencies
            )),
            llama3_tokens=True,
        ),
        # sliding window of 8 tokens on every layer: test prompts + generations are longer than that
        ModelPreset("tiny-mistral", "mistral", dict(_TINY, sliding_window=8)),
        # biased q/k/v, tied head, sliding windows from layer 2 on (layer_types from max_window_layers)
        ModelPreset("tiny-qwen2", "qwen2", dict(_TINY, tie_word_embeddings=True, use_sliding_window=True,
                                                 sliding_window=8, max_window_layers=2)),
        # q/k RMSNorm, head_dim (32) != hidden / heads (16)
        ModelPreset("tiny-qwen3", "qwen3", dict(_TINY, head_dim=32, tie_word_embeddings=True)),
        # 4 experts, 2 per token
        ModelPreset("tiny-mixtral", "mixtral", dict(_TINY, num_local_experts=4, num_experts_per_tok=2,
                                                     sliding_window=None)),
        # Falcon-40B layout: new decoder architecture, grouped KV heads, parallel attention + MLP, rotary
        ModelPreset("tiny-falcon", "falcon", dict(
            vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_kv_heads=2,
            new_decoder_architecture=True, parallel_attn=True, alibi=False, bias=False, max_position_embeddings=2048,
        )),
        # alternating sliding (8 tokens) / global layers, attention + final logit softcapping, scaled embeddings
        ModelPreset("tiny-gemma2", "gemma2", dict(
            _TINY, head_dim=16, sliding_window=8, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
            query_pre_attn_scalar=16, tie_word_embeddings=True,
        )),
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
        # Llama-3.1-8B shapes: 32 blocks, d_model 4096, FFN 14336, GQA 32/8 heads, vocabulary 128,256, Llama-3 rope
        # scaling. ~32 GB at float32, ~4.6 GB as a Q4_0 GGUF: `swarmlm model init --preset llama-8b --gguf q4_0`.
        ModelPreset(
            "llama-8b",
            "llama",
            dict(
                vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
                tie_word_embeddings=False, rope_parameters=dict(
                    rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192,
                ),
            ),
            tokenizer_vocab=4096,
            llama3_tokens=True,
        ),
    ]
}


def get_preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
