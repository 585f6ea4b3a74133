"""Tiny GGUF files written with gguf-py's GGUFWriter from a tiny-llama checkpoint (as llama.cpp's converter
would: its names, its q/k rotary permutation, a quantized type for the MLP), and SmolLM2's fetched once per
machine through the product's own catalog code."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

Q8_MATRICES = ("mlp.",)  # quantized (Q8_0: rows are multiples of its 32-value blocks); the rest stays F32


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's layout of q/k rows (what transformers' LlamaTensorProcessor undoes)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(checkpoint: str | Path, out: str | Path, architecture: str = "llama",
                    mlp_type: str = "Q8_0", matrix_type: str | None = None,
                    types: dict[str, str] | None = None) -> Path:
    """`mlp_type`: the MLP matrices' type; one gguf-py cannot dequantize (Q8_1) gets zero bytes of its size.
    `matrix_type`: if given, every matrix (attention, MLP, embeddings, head) in this type (gguf-py quantizes it);
    `types`: a matrix whose name contains a key gets that key's type instead (mixed files, as llama.cpp writes)."""
    import gguf

    checkpoint, out = Path(checkpoint), Path(out)
    cfg = json.loads((checkpoint / "config.json").read_text())
    tensors = load_file(checkpoint / "model.safetensors")
    layers, heads, kv_heads = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(out, architecture)
    writer.add_block_count(layers)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    for hf_name, value in sorted(tensors.items()):
        stem, _, suffix = hf_name.rpartition(".")
        value = value.astype(np.float32)
        if "self_attn.q_proj" in hf_name:
            value = _permute(value, heads)
        elif "self_attn.k_proj" in hf_name:
            value = _permute(value, kv_heads)
        name = f"{names.get_name(stem)}.{suffix}"
        qtype = gguf.GGMLQuantizationType[mlp_type]
        if matrix_type == "F16" and value.ndim == 2:
            writer.add_tensor(name, value.astype(np.float16))
        elif matrix_type is not None and value.ndim == 2:
            chosen = [t for part, t in (types or {}).items() if part in hf_name]
            qtype = gguf.GGMLQuantizationType[chosen[0] if chosen else matrix_type]
            writer.add_tensor(name, gguf.quantize(value, qtype), raw_dtype=qtype)
        elif any(q in hf_name for q in Q8_MATRICES) and mlp_type == "Q8_0":
            writer.add_tensor(name, gguf.quantize(value, qtype), raw_dtype=qtype)
        elif any(q in hf_name for q in Q8_MATRICES):
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            raw = np.zeros((value.shape[0], value.shape[1] // block * type_size), dtype=np.uint8)
            writer.add_tensor(name, raw, raw_dtype=qtype)
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
