"""A decode step in one kernel call (model/decode_span.py, kernels/decode.c) computes what the blocks' own
transformers forward computes: per family it takes, for one session and for several batched with left padding, after
cache edits, past a sliding window; and spans it cannot compute exactly are left to transformers."""
from __future__ import annotations

import pytest
import torch

from swarmlm.model.decode_span import SpanDecoder
from swarmlm.model.packed import DIRECT_ROWS
from swarmlm.model.random_checkpoint import init_checkpoint
from swarmlm.server.stage import Stage, StepRequest
from swarmlm.types import BlockRange, CacheOp
from tests.gguf_fixtures import write_tiny_gguf

DECODED = ["tiny-llama", "tiny-llama3", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"]


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("decode-span")
    return {name: str(init_checkpoint(name, root / name, seed=3))
            for name in DECODED + ["tiny-gemma2", "tiny-bloom"]}


def twin_stages(model: str, blocks: BlockRange, quant: str) -> tuple[Stage, Stage]:
    """The same blocks twice; the second never uses the one-call decoder (transformers' forward)."""
    fast, plain = Stage(model, blocks, quant=quant), Stage(model, blocks, quant=quant)
    plain._span_decoder = lambda local: None
    return fast, plain


def run_both(stages, steps, max_length: int = 64) -> None:
    """steps: lists of (session index, hidden, new mask, op) run as one batch on both stages, outputs compared."""
    states = [[stage.new_state(stage.blocks, 2, max_length) for _ in range(2)] for stage in stages]
    for batch in steps:
        outs = [stage.step_batch([StepRequest(own[i], h, m, op) for i, h, m, op in batch])
                for stage, own in zip(stages, states)]
        for got, want in zip(*outs):
            assert rel_l2(got, want) < 1e-5


def kernel_steps(monkeypatch, what=lambda decoder: 1) -> list:
    """A list that gets what(decoder) for every step the one-call decoder computes (not for those it refuses: a
    padding query)."""
    calls, step = [], SpanDecoder.step

    def counted(self, *args):
        out = step(self, *args)
        if out is not None:
            calls.append(what(self))
        return out

    monkeypatch.setattr(SpanDecoder, "step", counted)
    return calls


def scenario(hidden_size: int) -> list:
    g = torch.Generator().manual_seed(0)

    def h(rows: int, t: int) -> torch.Tensor:
        return torch.randn(rows, t, hidden_size, generator=g)

    left_padded = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    return [
        [(0, h(2, 7), left_padded, None)], [(1, h(1, 3), torch.ones(1, 3), None)],  # prefills (transformers)
        [(0, h(2, 1), torch.ones(2, 1), None)],  # one session
        [(0, h(2, 1), torch.ones(2, 1), None), (1, h(1, 1), torch.ones(1, 1), None)],  # two, left-padded
        [(0, h(2, 1), torch.ones(2, 1), CacheOp(truncate_to=6, rows=(1, 0)))],  # after a cut and a row swap
        [(0, h(3, 1), torch.ones(3, 1), CacheOp(rows=(0, 1, 1)))],  # a row copied (n > 1, beams)
        *[[(0, h(3, 1), torch.ones(3, 1), None), (1, h(1, 1), torch.ones(1, 1), None)] for _ in range(8)],  # past 8
        [(0, h(3, 4), torch.ones(3, 4), CacheOp(truncate_to=12)), (1, h(1, 4), torch.ones(1, 4), None)],  # a draft
        [(0, h(3, 1), torch.ones(3, 1), CacheOp(truncate_to=14))],  # part of it accepted
    ]


@pytest.mark.parametrize("name", DECODED)
def test_a_decode_step_in_one_call_is_the_blocks_forward(checkpoints, name, monkeypatch):
    fast, plain = twin_stages(checkpoints[name], BlockRange(0, 4), quant="int8")
    calls = kernel_steps(monkeypatch)
    run_both((fast, plain), scenario(fast.hidden_size))
    assert len(calls) == 15  # every step of the fast stage but the left-padded prompt (a padding query) took it


def test_a_ggufs_own_blocks_decode_in_one_call(checkpoints, tmp_path):
    gguf = write_tiny_gguf(checkpoints["tiny-llama"], tmp_path / "tiny.gguf", matrix_type="Q4_0")
    fast, plain = twin_stages(str(gguf), BlockRange(1, 5), quant="auto")
    assert fast._span_decoder(slice(0, 4)) is not None
    run_both((fast, plain), scenario(fast.hidden_size))



def test_products_of_other_types_between_those_that_share_their_input(checkpoints, tmp_path):
    """decode.c's k and v take q's prepared activations, up takes gate's (kernels/packed.c `activations`): a file
    whose q and down products are of a type that prepares none (Q5_0) leaves nothing stale for the next k."""
    gguf = write_tiny_gguf(checkpoints["tiny-llama"], tmp_path / "mixed.gguf", matrix_type="Q4_0",
                           types={"q_proj": "Q5_0", "down_proj": "Q5_0"})
    fast, plain = twin_stages(str(gguf), BlockRange(0, 4), quant="auto")
    assert fast._span_decoder(slice(0, 4)) is not None
    run_both((fast, plain), scenario(fast.hidden_size))

@pytest.mark.parametrize("name, quant", [("tiny-llama", "none"), ("tiny-gemma2", "int8"),
                                         ("tiny-bloom", "int8")])
def test_what_the_kernel_does_not_compute_stays_with_transformers(checkpoints, name, quant):
    stage = Stage(checkpoints[name], BlockRange(0, 2), quant=quant)
    assert SpanDecoder.of(stage.config, stage.adapter, stage.modules, stage.dtype) is None


def test_prefill_padding_queries_and_gradients_are_left_to_transformers(checkpoints):
    stage = Stage(checkpoints["tiny-llama"], BlockRange(0, 2), quant="int8")
    decoder = stage._span_decoder(slice(0, 2))
    one = torch.zeros(2, 1, stage.hidden_size)
    with torch.inference_mode():
        assert decoder.usable(one)
        assert decoder.usable(torch.zeros(2, 5, stage.hidden_size))  # a draft, a short prompt
        assert not decoder.usable(torch.zeros(2, 40, stage.hidden_size))  # a longer prompt
        past = DIRECT_ROWS + 1
        assert not decoder.usable(torch.zeros(past, 1, stage.hidden_size))
        # a padding query: the kernel refuses the step before it computes or writes anything
        state = stage.new_state(stage.blocks, 2, 8)
        stage.step(state, torch.randn(2, 3, stage.hidden_size), torch.ones(2, 3))
        keys = state.cache.keys[:, :, :, :3].clone()
        masks = [torch.cat([state.mask, torch.tensor([[1], [0]])], dim=1)]
        assert decoder.step(torch.randn(2, 1, stage.hidden_size), [(state.cache, slice(0, 2))], masks) is None
        assert torch.equal(state.cache.keys[:, :, :, :3], keys) and not state.cache.keys[:, :, :, 3:].any()
    assert decoder.usable(one) and not decoder.usable(one.requires_grad_())  # gradients wanted for the input


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])  # AVX2 + FMA, and plain C: other CPUs' code paths
def test_other_cpus_builds_decode_as_the_blocks_forward(checkpoints, march, monkeypatch):
    import swarmlm.model.decode_span as decode_module
    import swarmlm.model.packed as packed_module
    from swarmlm.kernels import library

    other = library(march)
    monkeypatch.setattr(decode_module, "library", lambda: other)
    monkeypatch.setattr(packed_module, "library", lambda: other)
    fast, plain = twin_stages(checkpoints["tiny-qwen2"], BlockRange(0, 3), quant="int4")
    run_both((fast, plain), scenario(fast.hidden_size))


def test_the_one_call_decoder_splits_its_products_between_torchs_threads(checkpoints):
    """A server whose every step is a short one (decode, a short prompt) never runs PackedTensor.matmul: the one-call
    decoder itself tells the kernels' pool torch's thread count (a server with --threads 2 once decoded on one)."""
    from swarmlm.kernels import library

    stage = Stage(checkpoints["tiny-llama"], BlockRange(0, 2), quant="int8")
    decoder = stage._span_decoder(slice(0, 2))
    before = torch.get_num_threads()
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            state = stage.new_state(stage.blocks, 1, 8)
            with torch.inference_mode():
                stage.step_batch([StepRequest(state, torch.randn(1, 3, stage.hidden_size), torch.ones(1, 3), None)])
            assert decoder is not None and library().packed_threads() == threads
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rope, prompt", [({"rope_type": "default"}, 250),  # decodes past the first cos/sin table
                                          ({"rope_type": "dynamic", "factor": 2.0}, 10)])  # frequencies move at 16
def test_positions_past_the_rotary_table_and_a_dynamic_rotary(tmp_path, rope, prompt, monkeypatch):
    import json

    path = init_checkpoint("tiny-llama", tmp_path / "model", seed=5)
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {"rope_theta": 10000.0, **rope}
    config["max_position_embeddings"] = 16 if rope["rope_type"] == "dynamic" else 2048
    (path / "config.json").write_text(json.dumps(config))
    fast, plain = twin_stages(str(path), BlockRange(0, 2), quant="int8")
    calls = kernel_steps(monkeypatch)
    g = torch.Generator().manual_seed(1)
    steps = [[(0, torch.randn(1, prompt, fast.hidden_size, generator=g), torch.ones(1, prompt), None)]]
    steps += [[(0, torch.randn(1, 1, fast.hidden_size, generator=g), torch.ones(1, 1), None)] for _ in range(12)]
    run_both((fast, plain), steps, max_length=prompt + 12)
    assert len(calls) == (12 if prompt > DIRECT_ROWS else 13)  # every decode step (and a short prompt) took it


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (12, 2, 64), (6, 2, 128), (8, 1, 32), (4, 4, 16)])
def test_query_heads_of_one_kv_head_attend_together(tmp_path, heads, kv_heads, head_dim, monkeypatch):
    """decode.c takes up to 4 query heads of one kv head together (2 of 128 dimensions): groups of 3 (SmolLM2), of 6
    (4 + 2), of 3 at 128 dimensions (2 + 1), of 8 (4 + 4) and of 1 decode as the blocks' own forward."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    path = init_checkpoint("tiny-llama", tmp_path / "model", seed=5, num_layers=2)
    config = json.loads((path / "config.json").read_text())
    config.update(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)
    torch.manual_seed(7)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")}))
    for file in path.glob("*.safetensors*"):
        file.unlink()
    model.save_pretrained(path)
    fast, plain = twin_stages(str(path), BlockRange(0, 2), quant="int8")
    calls = kernel_steps(monkeypatch)
    run_both((fast, plain), scenario(fast.hidden_size))
    assert len(calls) == 15


def test_a_decode_steps_span_call_makes_no_failed_lookup(checkpoints):
    """What every server of a chain pays once per token with its caches cold (docs/RESULTS-hop.md round 16): no
    ctypes attribute lookup that fails (a missing symbol and an AttributeError, ~20-30 us cold); the caller's tensor
    stays as it was, the output is the blocks' own."""
    import sys

    from swarmlm.kernels import library

    fast, plain = twin_stages(checkpoints["tiny-llama"], BlockRange(0, 2), quant="int8")
    states = [stage.new_state(stage.blocks, 1, 16) for stage in (fast, plain)]
    prompt, token = torch.randn(1, 4, fast.hidden_size), torch.randn(1, 1, fast.hidden_size)
    one = torch.ones(1, 1, dtype=torch.long)  # (as the server's: a mask of another dtype is converted, a copy)
    for stage, state in zip((fast, plain), states):
        stage.step(state, prompt, torch.ones(1, 4, dtype=torch.long))
    kept = token.clone()
    called, before = [], torch.get_num_threads()
    torch.set_num_threads(1)  # a server's default, with the kernels as a server process first loads them
    library.cache_clear()
    library()
    sys.setprofile(lambda frame, event, arg: called.append(frame.f_code.co_name) if event == "call" else None)
    try:
        got = fast.step(states[0], token, one)
    finally:
        sys.setprofile(None)
        torch.set_num_threads(before)
    assert fast._span_decoder(slice(0, 2)) is not None and "_forward" not in called  # the kernel computed it
    assert "__getattr__" not in called and "__getitem__" not in called  # (CDLL's, for a name it does not hold)
    assert torch.equal(token, kept) and got.data_ptr() != token.data_ptr()
    assert rel_l2(got, plain.step(states[1], token, one)) < 1e-5
