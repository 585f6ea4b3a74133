"""The streaming GGUF writer (`swarmlm model init --gguf`): its file reads back through gguf-py and transformers to the
random source values (F32 exactly, Q8_0/Q4_0 within their quantization step), with a working config and tokenizer,
and writing takes memory near one chunk of rows, not one tensor."""
from __future__ import annotations

import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, LlamaConfig

from swarmlm.model.checkpoint import load_transformers_model
from swarmlm.model.gguf import open_gguf
from swarmlm.model.gguf_writer import _llama_cpp_rows, plan_tensors, source_values, write_gguf
from swarmlm.model.random_checkpoint import preset_config
from swarmlm.model.tokenizer import train_tokenizer

SEED = 5
# the largest error of one value, as a fraction of its tensor's largest magnitude: Q8_0 rounds to 1/127 of a
# 32-value block's largest magnitude (half a step), Q4_0 to 1/8 of it (a whole step where the top value clips);
# 1 % for the scale stored as float16
STEP = {"f32": 0.0, "q8_0": 1 / 127, "q4_0": 1 / 8}


def _source(config, tensor) -> np.ndarray:
    parts = [values for _, values in source_values(config, tensor, SEED)]
    return np.concatenate(parts) if tensor.shape != (tensor.shape[0],) or len(parts) > 1 else parts[0]


def _close(got: np.ndarray, want: np.ndarray, gguf_type: str, name: str) -> None:
    assert got.shape == want.shape, name
    if gguf_type == "f32" or want.ndim == 1:  # norms and rope factors are F32 in every file
        assert np.array_equal(got, want), name
        return
    error = np.abs(got - want).max()
    assert 0 < error <= STEP[gguf_type] * np.abs(want).max() * 1.01, (name, error)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swarmlm.cli.main", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("gguf_type", ["q4_0", "q8_0", "f32"])
def test_the_file_reads_back_to_the_source_values(tmp_path, gguf_type):
    import gguf

    done = _cli("model", "init", "--preset", "tiny-llama", "--gguf", gguf_type, "--seed", str(SEED),
                "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    path = tmp_path / f"tiny-llama-seed{SEED}.{gguf_type}.gguf"
    assert done.stdout.strip() == str(path)
    config = preset_config("tiny-llama")
    plan = {t.name: t for t in plan_tensors(config, gguf_type)}
    read = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert set(read) == set(plan)
    for name, tensor in plan.items():  # gguf-py: llama.cpp's layout (q/k rows permuted per head)
        assert read[name].tensor_type == tensor.qtype, name
        got = gguf.dequantize(read[name].data, read[name].tensor_type)
        _close(got, _llama_cpp_rows(_source(config, tensor), tensor.head_rows), gguf_type, name)
    state = load_transformers_model(path).state_dict()  # transformers: its own layout, q/k rows back in order
    hf_to_gguf = open_gguf(path).hf_to_gguf
    assert set(state) == set(hf_to_gguf)
    for key, value in state.items():
        _close(value.numpy(), _source(config, plan[hf_to_gguf[key]]), gguf_type, key)


def test_config_and_tokenizer_come_from_the_file(tmp_path):
    path = write_gguf(preset_config("tiny-llama3"), tmp_path / "tiny3.gguf", "q8_0", seed=SEED)
    config = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    want = preset_config("tiny-llama3")
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "head_dim", "tie_word_embeddings"):
        assert getattr(config, field) == getattr(want, field), field
    assert config.rope_parameters["rope_theta"] == want.rope_parameters["rope_theta"]
    assert config.rms_norm_eps == pytest.approx(want.rms_norm_eps)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    ours = train_tokenizer(512, pad=False)
    text = "The quick brown fox asks: what is the capital of France?"
    assert tokenizer(text).input_ids == ours(text).input_ids and tokenizer.decode(ours(text).input_ids) == text
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<s>", "</s>")


def test_chunked_writing_gives_the_same_file(tmp_path):
    config = preset_config("tiny-llama")
    whole = write_gguf(config, tmp_path / "whole.gguf", "q4_0", seed=SEED)
    chunked = write_gguf(config, tmp_path / "chunked.gguf", "q4_0", seed=SEED, chunk_bytes=1)  # one head a chunk
    assert whole.read_bytes() == chunked.read_bytes()
    other = write_gguf(config, tmp_path / "other.gguf", "q4_0", seed=SEED + 1)
    assert other.read_bytes() != whole.read_bytes()


@pytest.mark.parametrize("gguf_type", ["f32", "q4_0"])
def test_writing_holds_a_chunk_not_a_tensor(tmp_path, gguf_type):
    # embeddings and head of 32 MiB each at float32; chunks of 1 MiB
    config = LlamaConfig(vocab_size=32768, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    largest = max(t.shape[0] * t.shape[-1] * 4 for t in plan_tensors(config, "f32"))
    assert largest == 32 << 20
    tracemalloc.start()
    try:
        path = write_gguf(config, tmp_path / "wide.gguf", gguf_type, seed=SEED, chunk_bytes=1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < largest / 4, peak  # numpy reports its buffers to tracemalloc
    embed = load_transformers_model(path).state_dict()["model.embed_tokens.weight"]
    _close(embed.numpy(), _source(config, plan_tensors(config, gguf_type)[0]), gguf_type, "embed")
    assert embed.dtype == torch.float32


def test_a_preset_too_big_to_build_in_memory_points_to_gguf(tmp_path):
    import psutil

    if psutil.virtual_memory().available > 29 << 30:
        pytest.skip("this machine could build llama-8b at float32 in memory")
    done = _cli("model", "init", "--preset", "llama-8b", "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "llama-8b at float32 takes 29.9 GiB" in lines[0] and "--gguf q4_0" in lines[0]
    assert not (tmp_path / "out").exists()  # nothing written
