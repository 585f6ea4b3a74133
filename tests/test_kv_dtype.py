"""Float16 attention caches (--kv-dtype float16, server/kv_dtype.py): the one-call decoder (kernels/decode.c) reads
and writes them as transformers' path does, per family it takes, for several sessions with masks and cache edits and on
other CPUs' builds; a step differs from a float32 cache's only by float16's rounding of K/V; reservations, prefix
entries and cache ops hold half the bytes; a bad value is one clear error."""
from __future__ import annotations

import pytest
import torch

from swarmlm.config import ServerConfig
from swarmlm.model.random_checkpoint import init_checkpoint
from swarmlm.server.kv_cache import SpanCache
from swarmlm.server.kv_dtype import cache_dtype
from swarmlm.server.prefix_cache import PrefixCache
from swarmlm.server.stage import Stage, StepRequest
from swarmlm.types import BlockRange, CacheOp
from tests.gguf_fixtures import write_tiny_gguf
from tests.test_decode_span import DECODED, kernel_steps, rel_l2, scenario

torch.set_num_threads(1)
F16_STEP = 3e-3  # a step through 2-4 blocks from float16 K/V (2^-11 relative each) against float32 ones


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("kv-dtype")
    return {name: str(init_checkpoint(name, root / name, seed=3)) for name in DECODED + ["tiny-bloom"]}


def run_all(stages, steps, max_length: int = 64) -> list[list[torch.Tensor]]:
    """steps (as test_decode_span.scenario) run as batches on every stage; each stage's outputs, step by step."""
    states = [[stage.new_state(stage.blocks, 2, max_length) for _ in range(2)] for stage in stages]
    outs = [[] for _ in stages]
    for batch in steps:
        for stage, own, out in zip(stages, states, outs):
            out.extend(stage.step_batch([StepRequest(own[i], h, m, op) for i, h, m, op in batch]))
    for own in states:
        for state in own:
            assert state.cache.dtype == own[0].cache.dtype and state.cache.keys.dtype == state.cache.dtype
    return outs


def kernel_and_transformers(model: str, blocks: BlockRange, quant: str, wide_plain: bool = False) -> tuple:
    """float16 caches through the one-call decoder, float16 through transformers, float32 through the decoder (and,
    with wide_plain, float32 through transformers)."""
    fast, plain = (Stage(model, blocks, quant=quant, kv_dtype="float16") for _ in range(2))
    plain._span_decoder = lambda local: None
    wide = [Stage(model, blocks, quant=quant, kv_dtype="float32") for _ in range(2 if wide_plain else 1)]
    if wide_plain:
        wide[1]._span_decoder = lambda local: None
    return fast, plain, *wide


@pytest.mark.parametrize("name", DECODED)
def test_float16_caches_decode_in_one_call_as_transformers_and_near_float32(checkpoints, name, monkeypatch):
    stages = kernel_and_transformers(checkpoints[name], BlockRange(0, 4), quant="int8", wide_plain=True)
    calls = kernel_steps(monkeypatch, lambda decoder: decoder.kv_dtype)
    got, want, f32, f32_plain = run_all(stages, scenario(stages[0].hidden_size))
    assert calls.count(torch.float16) == 15 and calls.count(torch.float32) == 15  # both decoders ran every decode
    for g, w, f, fp in zip(got, want, f32, f32_plain):
        assert rel_l2(g, w) < 1e-5  # the kernel and transformers read the same float16 bits
        assert rel_l2(f, fp) < 1e-5  # and the same float32 ones
        assert rel_l2(g, f) < F16_STEP
    assert max(rel_l2(g, f) for g, f in zip(got, f32)) > 0  # the cache did hold float16


def test_a_ggufs_blocks_and_other_cpus_builds_read_float16_caches(checkpoints, tmp_path, monkeypatch):
    import swarmlm.model.decode_span as decode_module
    import swarmlm.model.packed as packed_module
    from swarmlm.kernels import library

    gguf = write_tiny_gguf(checkpoints["tiny-llama"], tmp_path / "tiny.gguf", matrix_type="Q4_0")
    for march in ("native", "x86-64-v3", "x86-64"):  # AVX-512, AVX2 + FMA, plain C
        other = library(march)
        monkeypatch.setattr(decode_module, "library", lambda: other)
        monkeypatch.setattr(packed_module, "library", lambda: other)
        fast, plain, wide = kernel_and_transformers(str(gguf), BlockRange(1, 5), quant="auto")
        assert fast._span_decoder(slice(0, 4)).kv_dtype == torch.float16
        got, want, f32 = run_all((fast, plain, wide), scenario(fast.hidden_size))
        for g, w, f in zip(got, want, f32):
            assert rel_l2(g, w) < 1e-5 and rel_l2(g, f) < F16_STEP


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(12, 2, 64), (6, 2, 128), (8, 1, 32), (4, 4, 16), (2, 2, 24)])
def test_every_head_size_reads_float16(tmp_path, heads, kv_heads, head_dim):
    """The AVX-512 attention's 1, 2, 4 and 8-vector heads, and the plain loop (24 dimensions)."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    path = init_checkpoint("tiny-llama", tmp_path / "model", seed=5, num_layers=2)
    config = json.loads((path / "config.json").read_text())
    config.update(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  head_dim=head_dim)
    torch.manual_seed(7)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")}))
    for file in path.glob("*.safetensors*"):
        file.unlink()
    model.save_pretrained(path)
    fast, plain, wide = kernel_and_transformers(str(path), BlockRange(0, 2), quant="int8")
    got, want, f32 = run_all((fast, plain, wide), scenario(fast.hidden_size))
    for g, w, f in zip(got, want, f32):
        assert rel_l2(g, w) < 1e-5 and rel_l2(g, f) < F16_STEP


def test_other_families_attend_from_float16_caches_through_transformers(checkpoints):
    """BLOOM (alibi, no one-call decoder): prefill, batched sessions with left padding and cache edits."""
    half, wide = (Stage(checkpoints["tiny-bloom"], BlockRange(0, 3), kv_dtype=kv) for kv in ("float16", "float32"))
    assert half._span_decoder(slice(0, 3)) is None
    got, f32 = run_all((half, wide), scenario(half.hidden_size))
    for g, f in zip(got, f32):
        assert rel_l2(g, f) < F16_STEP


def test_reservations_and_prefix_entries_hold_half_the_bytes(checkpoints):
    model = checkpoints["tiny-llama"]
    half, wide = (Stage(model, BlockRange(0, 2), quant="int8", kv_dtype=kv) for kv in ("float16", "float32"))
    assert half.cache_bytes(2, 3, 100) * 2 == wide.cache_bytes(2, 3, 100) > 0
    prefixes = PrefixCache(1 << 30)
    sizes = []
    for stage in (half, wide):
        state = stage.new_state(stage.blocks, 1, 64)
        x = torch.randn(1, 40, stage.hidden_size, generator=torch.Generator().manual_seed(1))
        stage.step(state, x, torch.ones(1, 40, dtype=torch.long))
        assert state.cache.keys.dtype == stage.kv_dtype
        # what the cache holds is what the reservation priced, per token
        assert state.cache.keys.numel() * 2 * state.cache.keys.element_size() == \
            stage.cache_bytes(2, 1, state.cache.capacity)
        before = prefixes.bytes
        assert prefixes.save(bytes([len(sizes)]) * 32, stage.blocks, (b"k" * 16,), state.cache, 1 << 30)
        sizes.append(prefixes.bytes - before)
        entry, runs = prefixes.lookup(bytes([len(sizes) - 1]) * 32, stage.blocks, (b"k" * 16,))
        restored, _ = prefixes.restore(entry, runs, 64)
        assert restored.dtype == stage.kv_dtype and restored.keys.dtype == stage.kv_dtype
    assert sizes[0] * 2 == sizes[1]


def test_a_server_placing_itself_prices_a_session_as_its_stage_reserves_it(checkpoints):
    from swarmlm.server.placement import model_spec

    model = checkpoints["tiny-llama"]
    for kv in ("float16", "float32"):
        spec = model_spec(ServerConfig(model_dir=model, blocks=None, kv_dtype=kv, max_length_tokens=100))
        stage = Stage(model, BlockRange(0, 1), quant="int8", kv_dtype=kv)
        assert spec.cache_bytes_per_session_block == stage.cache_bytes(1, 1, 100)


def test_cache_ops_keep_a_float16_cache():
    cache = SpanCache(2, 16, torch.float16)
    key = torch.randn(3, 2, 5, 8)
    cache.write(0, key, key)
    cache.write(1, key, key)
    cache.commit(5)
    assert cache.keys.dtype == torch.float16 and torch.equal(cache.keys[0, :, :, :5], key.half())
    cut, picked = cache.truncated(3), cache.selected(torch.tensor([2, 2, 0]))
    assert cut.dtype == picked.dtype == picked.keys.dtype == torch.float16
    assert torch.equal(picked.keys[1, 1, :, :5], key[2].half())
    empty = cache.truncated(0)
    empty.write(0, key, key)  # regrown after a cut to nothing: still float16
    assert empty.keys.dtype == torch.float16


def test_a_bad_kv_dtype_is_one_clear_error():
    with pytest.raises(ValueError, match="kv_dtype must be one of auto, float32, float16, got 'int8'"):
        ServerConfig(model_dir="m", blocks=None, kv_dtype="int8")
    with pytest.raises(ValueError, match="kv_dtype 'float16' needs float32 blocks"):
        cache_dtype("float16", torch.bfloat16)


def test_caches_keep_the_blocks_dtype_unless_told(checkpoints, tmp_path):
    """auto: the blocks' compute dtype, packed or not (float16 is opt-in: RESULTS-packed round 13)."""
    gguf = str(write_tiny_gguf(checkpoints["tiny-llama"], tmp_path / "tiny.gguf", matrix_type="Q4_0"))
    blocks = BlockRange(0, 2)
    assert Stage(gguf, blocks).kv_dtype == torch.float32
    assert Stage(gguf, blocks, kv_dtype="float16").kv_dtype == torch.float16
    assert Stage(checkpoints["tiny-llama"], blocks, quant="int8").kv_dtype == torch.float32
    assert cache_dtype("auto", torch.bfloat16) == torch.bfloat16 and cache_dtype("float16", torch.float32) == torch.float16


def test_the_server_command_takes_the_flag(checkpoints):
    from swarmlm.cli.main import build_parser
    from swarmlm.cli.server_cmd import server_config

    parser = build_parser("server")
    with pytest.raises(SystemExit):
        parser.parse_args(["server", "--model", "m", "--kv-dtype", "bf8"])
    args = parser.parse_args(["server", "--model", checkpoints["tiny-llama"], "--kv-dtype", "float16"])
    assert server_config(args).kv_dtype == "float16"
