"""GGUF checkpoints without any download: a tiny Llama written with gguf-py's GGUFWriter (F32 and Q8_0 tensors, the
q/k rows in llama.cpp's order) reads back as transformers reads it, one block at a time; bad files are one line.
Dequantized here (quant "none"): the packed form of the same blocks is tests/test_packed.py's."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from swarmlm.model.checkpoint import load_blocks, load_client_modules, load_config, load_transformers_model
from swarmlm.model.gguf import GGUFError, open_gguf
from swarmlm.model.fingerprint import Fingerprints, model_identity
from swarmlm.model.random_checkpoint import init_checkpoint
from tests.gguf_fixtures import write_tiny_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[str, str]:
    """(safetensors checkpoint, the same written as GGUF)"""
    root = tmp_path_factory.mktemp("tiny-gguf")
    checkpoint = init_checkpoint("tiny-llama", root / "checkpoint", seed=2)
    return str(checkpoint), str(write_tiny_gguf(checkpoint, root / "tiny-llama.gguf"))


def _block_state(blocks, start: int) -> dict[str, torch.Tensor]:
    return {f"model.layers.{start + i}.{k}": v for i, b in enumerate(blocks) for k, v in b.state_dict().items()}


def test_blocks_and_client_modules_are_transformers_own(tiny):
    checkpoint, gguf = tiny
    want = load_transformers_model(gguf).state_dict()  # transformers' from_pretrained(dir, gguf_file=...)
    original = load_transformers_model(checkpoint).state_dict()
    config, _, blocks = load_blocks(gguf, 2, 5, quant="none")
    assert config.num_hidden_layers == 6 and not config.tie_word_embeddings
    got = _block_state(blocks, 2)
    assert len(got) == 3 * 9
    for key, value in got.items():
        assert torch.equal(value, want[key]), key
        if "mlp" not in key:  # F32 in the file: the original values, q/k rows back in transformers' order
            assert torch.equal(value, original[key]), key
        else:  # Q8_0
            assert 0 < (value - original[key]).abs().max() < 0.01, key
    _, _, client = load_client_modules(gguf, quant="none")
    assert torch.equal(client.embed.weight, want["model.embed_tokens.weight"])
    assert torch.equal(client.final_norm.weight, want["model.norm.weight"])
    assert torch.equal(client.lm_head.weight, want["lm_head.weight"])


def test_a_block_range_dequantizes_only_its_tensors(tiny):
    _, gguf = tiny
    checkpoint = open_gguf(gguf)
    want = load_transformers_model(gguf).state_dict()
    before = checkpoint.dequantized_bytes
    load_blocks(gguf, 1, 3, quant="none")
    blocks_bytes = sum(v.nbytes for k, v in want.items() if k.startswith(("model.layers.1.", "model.layers.2.")))
    assert checkpoint.dequantized_bytes - before == blocks_bytes
    before = checkpoint.dequantized_bytes
    load_client_modules(gguf, quant="none")  # embeddings, final norm, head: no block
    client_keys = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
    assert checkpoint.dequantized_bytes - before == sum(want[k].nbytes for k in client_keys)


def test_identity_and_fingerprints_follow_the_file_not_its_path(tiny, tmp_path):
    checkpoint, gguf = tiny
    copy = shutil.copy(gguf, tmp_path / "renamed.gguf")
    assert model_identity(copy) == model_identity(gguf) and model_identity(gguf).startswith("llama-gguf-")
    assert Fingerprints(copy).range(0, 6) == Fingerprints(gguf).range(0, 6)
    other = write_tiny_gguf(init_checkpoint("tiny-llama", tmp_path / "seed3", seed=3), tmp_path / "seed3.gguf")
    assert model_identity(other) != model_identity(gguf)
    assert Fingerprints(other).range(2, 3) != Fingerprints(gguf).range(2, 3)
    assert load_config(copy).to_dict() == load_config(gguf).to_dict()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swarmlm.cli.main", *args], capture_output=True, text=True,
                          timeout=300)


def test_a_truncated_gguf_is_one_line_and_exit_2(tiny, tmp_path):
    _, gguf = tiny
    truncated = tmp_path / "truncated.gguf"
    data = open(gguf, "rb").read()
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(GGUFError, match="truncated"):
        load_config(truncated)
    done = _cli("profile", "--model", str(truncated), "--blocks", "0:1")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(truncated) in lines[0] and "not a readable GGUF file" in lines[0], done.stderr


def test_an_unknown_architecture_is_one_line_and_exit_2(tiny, tmp_path):
    checkpoint, _ = tiny
    alien = write_tiny_gguf(checkpoint, tmp_path / "alien.gguf", architecture="nosucharch")
    done = _cli("profile", "--model", str(alien), "--blocks", "0:1")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "'nosucharch' is not one transformers reads" in lines[0], done.stderr


def test_a_quantization_type_gguf_py_cannot_dequantize_is_one_line_and_exit_2(tiny, tmp_path):
    checkpoint, _ = tiny
    odd = write_tiny_gguf(checkpoint, tmp_path / "q8_1.gguf", mlp_type="Q8_1")
    done = _cli("profile", "--model", str(odd), "--blocks", "0:1")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "is Q8_1, a quantization type gguf-py cannot dequantize" in lines[0], done.stderr


def test_a_hub_snapshots_gguf_file_is_selected_by_gguf_file(tiny, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from swarmlm.model.source import gguf_in_snapshot
    from tests.hub_layout import add_to_hub_cache

    _, gguf = tiny
    only_gguf = tmp_path / "repo"
    only_gguf.mkdir()
    shutil.copy(gguf, only_gguf / "tiny-llama.Q8_0.gguf")
    cache = tmp_path / "hub"
    add_to_hub_cache(cache, "someone/tiny-llama-GGUF", only_gguf)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    path = gguf_in_snapshot("someone/tiny-llama-GGUF", "tiny-llama.Q8_0.gguf")
    assert path.endswith("tiny-llama.Q8_0.gguf") and model_identity(path) == model_identity(gguf)
    with pytest.raises(FileNotFoundError, match="other.gguf"):
        gguf_in_snapshot("someone/tiny-llama-GGUF", "other.gguf")
