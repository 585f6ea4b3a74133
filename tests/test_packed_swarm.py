"""Packed servers in a real swarm: a tiny Llama written as GGUF with every matrix in Q4_0 (Q8_0 for the MLP's
down projection), served in its own blocks by server processes (two per half: failover has somewhere to go),
gives transformers' tokens on the dequantized file through every path: greedy generation, a padded batch,
speculation, beam search (cache ops), the prefix cache, a SIGKILLed server, and training (gradients through the
dequantized weights). Every family's layers run packed linears: tests/test_packed.py and the int4 check below."""
from __future__ import annotations

import signal

import gguf
import numpy as np
import pytest
import torch

from swarmlm.model.random_checkpoint import init_checkpoint
from swarmlm.model.presets import PRESETS
from swarmlm.server.stage import Stage
from swarmlm.types import BlockRange
from tests.gguf_fixtures import write_tiny_gguf
from tests.swarm_helpers import assert_greedy_up_to_ties, reference_model, running_swarm

pytestmark = pytest.mark.slow
PROMPTS = [[1, 17, 88, 3, 9, 17, 88, 3, 9, 250], [1, 5, 6]]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def packed_swarm(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed-swarm")
    checkpoint = init_checkpoint("tiny-llama", root / "checkpoint", seed=5)
    path = str(write_tiny_gguf(checkpoint, root / "tiny-q4_0.gguf", matrix_type="Q4_0"))
    blocks = reference_model(path).config.num_hidden_layers
    halves = [BlockRange(0, blocks // 2), BlockRange(blocks // 2, blocks)]
    with running_swarm(path, halves + halves, ban_base_s=60.0) as (local, client):
        yield local, client, path, halves


def reference_tokens(path: str, prompt: list[int], new: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = reference_model(path).generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                                             do_sample=False)
    return out[0, len(prompt):].tolist()


def test_the_servers_hold_the_files_blocks(packed_swarm):
    local, client, path, _ = packed_swarm
    client(torch.tensor([PROMPTS[1]]))  # the client learns the records on its first route
    records = list(client.remote.view.records.values())
    plain = Stage(path, BlockRange(0, 3), quant="none")
    assert records and all(r.quant == "none" for r in records)  # the file's values: no lossy quantization
    assert all(0 < r.weight_bytes < 0.3 * plain.weight_bytes for r in records)


def test_greedy_generation_and_a_padded_batch_are_transformers_own(packed_swarm):
    _, client, path, _ = packed_swarm
    for prompt in PROMPTS:
        got = client.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        assert got[0, len(prompt):].tolist() == reference_tokens(path, prompt)
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    got = client.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          eos_token_id=None, pad_token_id=0)
    for row, prompt in zip(got.tolist(), PROMPTS):
        assert_greedy_up_to_ties(path, prompt, row[width:])


def test_speculation_and_beam_search_are_transformers_own(packed_swarm):
    _, client, path, _ = packed_swarm
    prompt = torch.tensor([PROMPTS[0]])
    got = client.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, speculative=4)
    assert client.last_stats.speculation["drafted"] > 0
    assert_greedy_up_to_ties(path, PROMPTS[0], got[0, prompt.shape[1]:].tolist())
    beams = dict(num_beams=3, num_return_sequences=2, max_new_tokens=6, early_stopping=True)
    got = client.generate(prompt, **beams)
    with torch.no_grad():
        want = reference_model(path).generate(prompt, **beams)
    assert torch.equal(got, want)


def test_a_prefix_is_reused_from_packed_servers(packed_swarm):
    _, client, path, _ = packed_swarm
    shared = PROMPTS[0] * 4
    client.generate(torch.tensor([shared + [7]]), max_new_tokens=2)
    got = client.generate(torch.tensor([shared + [8]]), max_new_tokens=4, min_new_tokens=4)
    assert client.last_stats.cached_tokens > 0  # the second request started from the first one's prefix
    assert got[0, len(shared) + 1:].tolist() == reference_tokens(path, shared + [8], 4)


def test_a_killed_packed_server_changes_no_token(packed_swarm):
    local, client, path, halves = packed_swarm
    prompt = PROMPTS[0]
    tokens = []
    with client.inference_session(max_length=len(prompt) + NEW_TOKENS) as session:
        logits = client.step_logits(session, torch.tensor([prompt]))
        for n in range(NEW_TOKENS):
            if n == 4:  # the server of the first half this session uses
                victim = next(s for s in local.servers if s.server_id == session.spans[0].span.server_id)
                local.kill(victim, signal.SIGKILL)
                victim.proc.wait(60)
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(nxt))
            if n + 1 < NEW_TOKENS:
                logits = client.step_logits(session, nxt)
        assert sum(s.failovers for s in session.steps) == 1
    assert tokens == reference_tokens(path, prompt)
    local.servers.remove(victim)
    local.start_server(halves[0])


def test_training_through_packed_servers_gives_the_dequantized_files_gradients(packed_swarm):
    _, client, path, _ = packed_swarm
    ids = torch.tensor([PROMPTS[0]])
    embeds = client.client_modules.embed(ids).detach().requires_grad_(True)
    loss = client(inputs_embeds=embeds, labels=ids).loss
    loss.backward()
    ref = reference_model(path)
    want_embeds = ref.get_input_embeddings()(ids).detach().requires_grad_(True)
    want = ref(inputs_embeds=want_embeds, labels=ids).loss
    want.backward()
    assert abs(loss.item() - want.item()) < 1e-4
    assert float((embeds.grad - want_embeds.grad).norm() / want_embeds.grad.norm()) < 1e-3


@pytest.mark.parametrize("preset", ["tiny-bloom", "tiny-llama3", "tiny-mistral", "tiny-qwen2", "tiny-qwen3",
                                    "tiny-mixtral", "tiny-falcon", "tiny-gemma2"])
def test_every_familys_blocks_run_packed_linears(preset, tmp_path):
    """int4 (Q4_1 blocks) on each family's own decoder layers: every linear layer whose inputs are whole blocks is
    packed, and the span's output stays near the float one."""
    from swarmlm.model.packed import PackedLinear

    path = str(init_checkpoint(preset, tmp_path / preset, seed=4))
    n = 2
    packed, plain = Stage(path, BlockRange(0, n), quant="int4"), Stage(path, BlockRange(0, n), quant="none")
    assert sum(isinstance(m, PackedLinear) for m in packed.modules.modules()) >= 3 * n
    hidden_size = packed.hidden_size
    hidden = torch.randn(1, 7, hidden_size, generator=torch.Generator().manual_seed(0))
    got = packed.forward(BlockRange(0, n), hidden, torch.ones(1, 7))
    want = plain.forward(BlockRange(0, n), hidden, torch.ones(1, 7))
    assert float((got - want).norm() / want.norm()) < 0.2, preset
    assert PRESETS[preset].family  # the preset names a family the loader knows
