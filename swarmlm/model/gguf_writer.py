"""`swarmlm model init --preset NAME --gguf q4_0`: a random Llama-family checkpoint written straight to one GGUF file,
tensor by tensor and row chunk by row chunk, so writing a model larger than the machine takes memory near one chunk.

The file is what llama.cpp's converter would write for such a model: its tensor names, q/k rows in its rotary
order, 2-D weights in the chosen type (Q4_0/Q8_0/F16/F32), norms in F32, Llama-3 rope scaling as a `rope_freqs`
tensor, and a byte-level BPE tokenizer (model/tokenizer.py's, padded with unused `[PADn]` tokens to the model's
vocabulary) in `tokenizer.ggml.*`, so transformers (`from_pretrained(dir, gguf_file=...)`), gguf-py and llama.cpp
all read it.

Values (a fixed seed): 2-D weights uniform in [-a, a] with a = initializer_range * sqrt(3) (transformers' init has
that standard deviation; uniform is ~4x faster to draw than normal), norms 1 + the same noise. Each tensor has its
own generator (seed, tensor index), drawn in row order, so a chunked write equals `source_values` drawn whole.
Note: transformers' GGUF reader ignores `rope_freqs` (it reads no Llama-3 scaling from a GGUF), so the swarm and
transformers run the file without it; llama.cpp applies it.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # (the CLI's parser imports GGUF_TYPES: no transformers for `--help`)
    from transformers import PretrainedConfig

GGUF_TYPES = ("q4_0", "q8_0", "f16", "f32")  # what --gguf takes: the type of every 2-D weight
CHUNK_BYTES = 64 << 20  # float32 bytes drawn (and quantized) at once: the writer's working set is a few of these
UNUSED_TOKEN = 5  # llama.cpp's token types: 1 normal, 3 control, 5 unused
NORMAL_TOKEN, CONTROL_TOKEN = 1, 3


@dataclass(frozen=True)
class PlannedTensor:
    name: str  # GGUF name, e.g. blk.3.attn_q.weight
    shape: tuple[int, ...]  # numpy order: (rows, columns) or (n,)
    qtype: object  # gguf.GGMLQuantizationType
    head_rows: int = 0  # q/k: rows per head, permuted within a head into llama.cpp's rotary order (0: none)
    norm: bool = False  # 1 + noise rather than noise

    @property
    def nbytes(self) -> int:
        from gguf import GGML_QUANT_SIZES

        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape[:-1]) * (self.shape[-1] // block) * type_size


def plan_tensors(config: PretrainedConfig, gguf_type: str) -> list[PlannedTensor]:
    """Every tensor of the file, in file order (embeddings, blocks, final norm, head)."""
    from gguf import GGMLQuantizationType as Q

    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"--gguf {gguf_type!r}: one of {', '.join(GGUF_TYPES)}")
    matrix = Q[gguf_type.upper()]
    h, ffn, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    plan = [PlannedTensor("token_embd.weight", (vocab, h), matrix)]
    if _rope_factors(config) is not None:
        plan.append(PlannedTensor("rope_freqs.weight", (head_dim // 2,), Q.F32))
    for i in range(config.num_hidden_layers):
        b = f"blk.{i}."
        plan += [
            PlannedTensor(b + "attn_norm.weight", (h,), Q.F32, norm=True),
            PlannedTensor(b + "attn_q.weight", (heads * head_dim, h), matrix, head_rows=head_dim),
            PlannedTensor(b + "attn_k.weight", (kv_heads * head_dim, h), matrix, head_rows=head_dim),
            PlannedTensor(b + "attn_v.weight", (kv_heads * head_dim, h), matrix),
            PlannedTensor(b + "attn_output.weight", (h, heads * head_dim), matrix),
            PlannedTensor(b + "ffn_norm.weight", (h,), Q.F32, norm=True),
            PlannedTensor(b + "ffn_gate.weight", (ffn, h), matrix),
            PlannedTensor(b + "ffn_up.weight", (ffn, h), matrix),
            PlannedTensor(b + "ffn_down.weight", (h, ffn), matrix),
        ]
    plan.append(PlannedTensor("output_norm.weight", (h,), Q.F32, norm=True))
    if not config.tie_word_embeddings:
        plan.append(PlannedTensor("output.weight", (vocab, h), matrix))
    return plan


def source_values(config: PretrainedConfig, tensor: PlannedTensor, seed: int, chunk_bytes: int = CHUNK_BYTES):
    """The tensor's float32 values in transformers' layout (q/k rows not permuted), chunk by chunk: (row, array)."""
    index = [t.name for t in plan_tensors(config, "f32")].index(tensor.name)
    rng = np.random.default_rng([seed, index])
    if tensor.name == "rope_freqs.weight":
        yield 0, _rope_factors(config)
        return
    cols = tensor.shape[-1] if len(tensor.shape) > 1 else tensor.shape[0]
    rows = tensor.shape[0] if len(tensor.shape) > 1 else 1
    unit = tensor.head_rows or 1  # a chunk holds whole heads (their rows are permuted)
    step = max(unit, chunk_bytes // (4 * cols) // unit * unit)
    half_width = float(config.initializer_range) * math.sqrt(3)
    for row in range(0, rows, step):
        values = rng.random((min(step, rows - row), cols), dtype=np.float32)
        values -= np.float32(0.5)
        values *= np.float32(2 * half_width)
        if tensor.norm:
            values += np.float32(1.0)
        yield row, values if len(tensor.shape) > 1 else values[0]


def write_gguf(config: PretrainedConfig, out: str | Path, gguf_type: str = "q4_0", seed: int = 0,
               tokenizer_vocab: int = 512, pad_token: bool = True, chunk_bytes: int = CHUNK_BYTES,
               name: str = "swarmlm-random") -> Path:
    """Write the file (atomically: a temporary name, renamed when complete)."""
    import gguf

    if config.model_type != "llama":
        raise ValueError(f"--gguf writes Llama-family presets; this one is {config.model_type!r}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plan = plan_tensors(config, gguf_type)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(tmp, "llama")
    _add_model_fields(writer, config, gguf_type, name, seed)
    _add_tokenizer(writer, config, tokenizer_vocab, pad_token)
    for t in plan:
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    try:
        fout = writer.fout[0]
        for t in plan:
            writer.write_padding(fout, fout.tell())
            written = 0
            for _, values in source_values(config, t, seed, chunk_bytes):
                data = gguf.quantize(_llama_cpp_rows(values, t.head_rows), t.qtype)
                data.tofile(fout)
                written += data.nbytes
            assert written == t.nbytes, (t.name, written, t.nbytes)
        writer.write_padding(fout, fout.tell())
    finally:
        writer.close()
    os.replace(tmp, out)
    return out


def _llama_cpp_rows(values: np.ndarray, head_rows: int) -> np.ndarray:
    """q/k rows in llama.cpp's rotary order (what transformers' LlamaTensorProcessor undoes); values hold whole
    heads of head_rows rows. Rows are independent for the quantizer: permuting before quantizing permutes the file's
    rows."""
    if not head_rows:
        return values
    n = values.shape[0] // head_rows
    return values.reshape(n, 2, head_rows // 2, values.shape[1]).swapaxes(1, 2).reshape(values.shape)


def _add_model_fields(writer, config: PretrainedConfig, gguf_type: str, name: str, seed: int) -> None:
    from gguf import LlamaFileType

    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_name(name)
    writer.add_file_type(int(LlamaFileType[f"MOSTLY_{gguf_type.upper()}" if gguf_type.startswith("q")
                                            else f"ALL_{gguf_type.upper()}"]))
    writer.add_quantization_version(2)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    writer.add_uint32("swarmlm.seed", seed)


def _add_tokenizer(writer, config: PretrainedConfig, tokenizer_vocab: int, pad_token: bool) -> None:
    """model/tokenizer.py's byte-level BPE as llama.cpp stores one ("gpt2" model), padded to the vocabulary."""
    import json

    from swarmlm.model.tokenizer import BOS_ID, EOS_ID, PAD_ID, SPECIAL_TOKENS, UNK_ID, train_tokenizer

    tokenizer = train_tokenizer(min(tokenizer_vocab, config.vocab_size), pad=pad_token)
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    by_id = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    assert [i for _, i in by_id] == list(range(len(by_id))), "token ids are 0..n-1"
    vocab = [t for t, _ in by_id] + [f"[PAD{i}]" for i in range(len(by_id), config.vocab_size)]
    types = [CONTROL_TOKEN if t in SPECIAL_TOKENS else NORMAL_TOKEN for t, _ in by_id]
    types += [UNUSED_TOKEN] * (config.vocab_size - len(by_id))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(vocab)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_unk_token_id(UNK_ID)
    if pad_token:
        writer.add_pad_token_id(PAD_ID)
    writer.add_add_bos_token(False)


def _rope_factors(config: PretrainedConfig) -> np.ndarray | None:
    """Llama-3 rope scaling as llama.cpp's converter stores it: one divisor per rotary frequency."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") != "llama3":
        return None
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    base, factor = float(rope["rope_theta"]), float(rope["factor"])
    low, high, old = float(rope["low_freq_factor"]), float(rope["high_freq_factor"]), rope[
        "original_max_position_embeddings"]
    factors = []
    for freq in 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim):
        wavelength = 2 * math.pi / freq
        if wavelength < old / high:
            factors.append(1.0)
        elif wavelength > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)
