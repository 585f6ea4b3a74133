"""A session's deep prompt on the server (server/deep_prompt.py): checked at open from the header, added at the
session's first K positions whichever steps write them, and out of the way of every other session's batch. The
end-to-end match with transformers + PEFT: tests/test_training_swarm.py; hostile opens against a live server:
tests/test_attacks.py."""
from __future__ import annotations

import pytest
import torch

from swarmlm.errors import InvalidRequest
from swarmlm.server.deep_prompt import decode_prompts
from swarmlm.server.stage import Stage, StepRequest
from swarmlm.server.training import TrainRequest, forward_block
from swarmlm.types import BlockRange, CacheOp
from tests.test_attacks import hostile_tuned_opens

torch.set_num_threads(1)
K = 3


@pytest.fixture(scope="module", params=["llama", "bloom"])
def stage(request, checkpoints) -> Stage:
    return Stage(checkpoints[request.param], BlockRange(1, 5))


def test_every_hostile_prompt_is_refused_from_its_header_or_values():
    blocks, hidden = 4, 32
    for what, request in hostile_tuned_opens(hidden, blocks):
        if request.open.prefix_scope or request.open.lora:  # (the service's checks: tests/test_attacks.py)
            continue
        with pytest.raises(InvalidRequest, match="prompts"):
            decode_prompts(request.open.prompts, BlockRange(0, blocks), 64, hidden)
    good = next(r for what, r in hostile_tuned_opens(hidden, blocks) if what == "prompts beside a prefix scope")
    ok = decode_prompts(good.open.prompts, BlockRange(0, blocks), 64, hidden)
    assert ok.shape == (blocks, 2, hidden) and ok.dtype == torch.float32


def test_a_prompted_session_equals_the_stateless_forward_however_its_steps_are_cut(stage):
    """Positions < K get the prompt whether one step, chunks, or a truncation back into the prompt writes them."""
    blocks, h = BlockRange(2, 5), stage.hidden_size  # a sub-range of the stage's
    g = torch.Generator().manual_seed(0)
    x, prompts = torch.randn(2, 7, h, generator=g), torch.randn(blocks.length, K, h, generator=g)
    want = x
    for i in range(blocks.length):  # the training path, block by block: prompts[i] at the first K positions
        want = forward_block(stage, TrainRequest(blocks, x, torch.ones(2, 7, dtype=torch.long),
                                                 prompts.unsqueeze(1).expand(-1, 2, -1, -1)), i, want)
    ones = torch.ones(2, 7, dtype=torch.long)
    whole = stage.step(stage.new_state(blocks, 2, 16, prompts=prompts), x, ones)
    state = stage.new_state(blocks, 2, 16, prompts=prompts)
    cut = torch.cat([stage.step(state, x[:, a:b], ones[:, a:b]) for a, b in ((0, 1), (1, 5), (5, 7))], dim=1)
    again = stage.step(state, x[:, 1:], ones[:, 1:], CacheOp(truncate_to=1))  # back into the prompt, the rest again
    plain = stage.step(stage.new_state(blocks, 2, 16), x, ones)
    for got in (whole, cut):
        assert (got - want).abs().max().item() < 1e-4
    assert (again - want[:, 1:]).abs().max().item() < 1e-4
    assert (whole - plain).abs().max().item() > 1e-3  # the prompt matters


def test_prompted_steps_run_alone_and_later_ones_batch_with_other_sessions(stage):
    blocks, h = BlockRange(1, 5), stage.hidden_size
    g = torch.Generator().manual_seed(1)
    prompts = torch.randn(blocks.length, K, h, generator=g)
    deep, plain = stage.new_state(blocks, 1, 16, prompts=prompts), stage.new_state(blocks, 1, 16)
    first = [StepRequest(s, torch.randn(1, 4, h, generator=g), torch.ones(1, 4, dtype=torch.long))
             for s in (deep, plain)]
    assert first[0].batch_key != first[1].batch_key  # the prompted prefill runs alone
    for r in first:
        stage.step_batch([r])
    alone_states = [stage.new_state(blocks, 1, 16, prompts=prompts), stage.new_state(blocks, 1, 16)]
    for s, r in zip(alone_states, first):
        stage.step(s, r.hidden, r.mask)
    x = torch.randn(2, 1, 1, h, generator=g)
    one = torch.ones(1, 1, dtype=torch.long)
    decodes = [StepRequest(deep, x[0], one), StepRequest(plain, x[1], one)]
    assert decodes[0].batch_key == decodes[1].batch_key  # past the prompt: an ordinary session
    together = stage.step_batch(decodes)
    apart = [stage.step(s, x[i], one) for i, s in enumerate(alone_states)]
    for a, b in zip(together, apart):
        assert (a - b).abs().max().item() < 1e-4


def test_a_session_with_a_client_lora_equals_the_stateless_forward_and_runs_alone(stage):
    """A client's own LoRA held by a session (OpenSession.lora): every step of it as the training path computes
    the same LoRA, and none of its steps shares a forward with another session's."""
    from swarmlm.server.lora import LoraDelta
    from swarmlm.server.training import linear_layers

    blocks, h = BlockRange(2, 5), stage.hidden_size
    g = torch.Generator().manual_seed(2)
    deltas = []
    for block in (2, 4):
        name, layer = next(iter(linear_layers(stage, block).items()))
        deltas.append(LoraDelta(block, name, torch.randn(4, layer.in_features, generator=g),
                                torch.randn(layer.out_features, 4, generator=g), 0.5))
    x, ones = torch.randn(2, 6, h, generator=g), torch.ones(2, 6, dtype=torch.long)
    want = x
    for i in range(blocks.length):
        want = forward_block(stage, TrainRequest(blocks, x, ones, None, tuple(deltas)), i, want)
    state = stage.new_state(blocks, 2, 16, client_lora=tuple(deltas))
    got = torch.cat([stage.step(state, x[:, :4], ones[:, :4]), stage.step(state, x[:, 4:5], ones[:, 4:5])], dim=1)
    decode = StepRequest(state, x[:, 5:], ones[:, 5:])
    other = StepRequest(stage.new_state(blocks, 2, 16), x[:, 5:], ones[:, 5:])
    assert decode.batch_key != other.batch_key  # (its LoRA hooks must see no other session's rows)
    got = torch.cat([got, stage.step_batch([decode])[0]], dim=1)
    plain = stage.step(stage.new_state(blocks, 2, 16), x, ones)
    assert (got - want).abs().max().item() < 1e-4
    assert (got - plain).abs().max().item() > 1e-3
