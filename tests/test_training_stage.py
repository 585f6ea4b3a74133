"""The server's training compute without a network (server/training.py): a span's block-by-block backward equals
autograd through the whole span; deep prompts and LoRA get their gradients; int8 blocks train too (within the
int8 error bound) and a LoRA applied on them changes no base weight."""
from __future__ import annotations

import pytest
import torch

from swarmlm.server import training
from swarmlm.server.lora import LoraDelta
from swarmlm.server.stage import Stage
from swarmlm.types import BlockRange

torch.set_num_threads(1)


def _span_grads(stage: Stage, req: training.TrainRequest, grad: torch.Tensor):
    inputs = [req.hidden]
    for i in range(req.blocks.length):
        inputs.append(training.forward_block(stage, req, i, inputs[-1]))
    prompt_grads, lora_grads = [], {}
    for i in reversed(range(req.blocks.length)):
        g = training.backward_block(stage, req, i, inputs[i], grad)
        grad = g.hidden
        prompt_grads.insert(0, g.prompt)
        lora_grads.update(g.lora)
    return inputs[-1], grad, prompt_grads, lora_grads


def _lora(stage: Stage, block: int, module: str, r: int = 2) -> training.LoraDelta:
    layer = training.linear_layers(stage, block)[module]
    g = torch.Generator().manual_seed(block)
    return LoraDelta(block, module, torch.randn(r, layer.in_features, generator=g) * 0.1,
                              torch.randn(layer.out_features, r, generator=g) * 0.1, 2.0)


def test_block_by_block_backward_equals_autograd_through_the_span(tiny_llama):
    stage = Stage(tiny_llama, BlockRange(0, 6))
    x = torch.randn(2, 7, stage.hidden_size)
    prompts = torch.randn(6, 2, 3, stage.hidden_size) * 0.1
    lora = (_lora(stage, 1, "self_attn.q_proj"), _lora(stage, 4, "mlp.down_proj"))
    req = training.TrainRequest(BlockRange(0, 6), x, torch.ones(2, 7, dtype=torch.long), prompts, lora)
    grad_out = torch.randn(2, 7, stage.hidden_size)
    out, gx, gp, gl = _span_grads(stage, req, grad_out)
    # the whole span under autograd at once
    leaves = [x.clone().requires_grad_(True), prompts.clone().requires_grad_(True)]
    mats = [t.clone().requires_grad_(True) for d in lora for t in (d.a, d.b)]
    deltas = tuple(LoraDelta(d.block, d.module, mats[2 * j], mats[2 * j + 1], d.scale)
                   for j, d in enumerate(lora))
    h = leaves[0]
    for i in range(6):
        h = training.block_call(stage, i, training.with_prompt(h, leaves[1], i), req.mask, deltas)
    (h * grad_out).sum().backward()
    assert torch.allclose(out, h.detach(), atol=1e-5)
    assert torch.allclose(gx, leaves[0].grad, atol=1e-5)
    assert torch.allclose(torch.stack(gp), leaves[1].grad, atol=1e-5)
    assert torch.allclose(gl[("self_attn.q_proj", "a")], mats[0].grad, atol=1e-5)
    assert torch.allclose(gl[("mlp.down_proj", "b")], mats[3].grad, atol=1e-5)


def test_int8_blocks_train_within_the_int8_bound_and_keep_their_weights(tiny_bloom):
    full, int8 = Stage(tiny_bloom, BlockRange(0, 6)), Stage(tiny_bloom, BlockRange(0, 6), quant="int8")
    before = {k: v.clone() for k, v in int8.modules.state_dict().items() if isinstance(v, torch.Tensor)}
    x = torch.randn(2, 6, full.hidden_size)
    lora = (_lora(full, 2, "self_attention.query_key_value"),)
    req = training.TrainRequest(BlockRange(0, 6), x, torch.ones(2, 6, dtype=torch.long), None, lora)
    grad_out = torch.randn(2, 6, full.hidden_size)
    _, want_x, _, want_l = _span_grads(full, req, grad_out)
    _, got_x, _, got_l = _span_grads(int8, req, grad_out)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(got_x, want_x) < 0.1
    assert rel(got_l[("self_attention.query_key_value", "a")], want_l[("self_attention.query_key_value", "a")]) < 0.1
    after = int8.modules.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not training.linear_layers(int8, 2)["self_attention.query_key_value"]._forward_hooks  # hooks removed


def test_training_memory_estimate_grows_with_the_request(tiny_llama):
    stage = Stage(tiny_llama, BlockRange(0, 2))
    small = training.backward_bytes(stage, 2, 1, 128)
    assert training.backward_bytes(stage, 2, 4, 128) == 4 * small
    assert training.backward_bytes(stage, 2, 1, 256) > 2 * small  # attention scores: quadratic in tokens
    with pytest.raises(KeyError):
        training.linear_layers(stage, 0)["no_such_layer"]


def test_kept_graphs_and_recomputation_give_the_same_gradients(tiny_llama):
    """The service keeps every block's graph when the request's memory bound allows, else recomputes each block:
    the same gradients either way (with deep prompts and LoRA)."""
    import asyncio

    from swarmlm.config import ServerConfig
    from swarmlm.server.scheduler import Scheduler
    from swarmlm.server.service import ServerStats, SwarmService

    stage = Stage(tiny_llama, BlockRange(0, 6))
    x = torch.randn(2, 7, stage.hidden_size)
    req = training.TrainRequest(BlockRange(1, 5), x, torch.ones(2, 7, dtype=torch.long),
                                torch.randn(4, 2, 2, stage.hidden_size) * 0.1, (_lora(stage, 2, "self_attn.v_proj"),))
    grad = torch.randn(2, 7, stage.hidden_size)
    recompute_only = training.backward_bytes(stage, 4, 2, 7)
    assert training.backward_bytes(stage, 4, 2, 7, kept_graphs=4) > recompute_only
    results = []
    for budget in (recompute_only, 1 << 30):
        service = SwarmService(ServerConfig(model_dir=tiny_llama, blocks=BlockRange(0, 6),
                                            max_train_request_bytes=budget), stage, Scheduler(1), ServerStats())
        try:
            results.append(asyncio.run(service.training.run_backward(req, grad)))
        finally:
            service.scheduler.stop()
    (gx1, gp1, gl1, *_), (gx2, gp2, gl2, *_) = results
    assert torch.allclose(gx1, gx2, atol=1e-6) and torch.allclose(gp1, gp2, atol=1e-6)
    assert gl1.keys() == gl2.keys() and all(torch.allclose(gl1[k], gl2[k], atol=1e-6) for k in gl1)



def test_a_moved_server_checks_and_trains_its_new_blocks(tiny_llama):
    """A server that moves to other blocks replaces its stage: the step checks and the training RPCs follow it (the
    training RPCs once kept the stage they started with)."""
    from swarmlm.config import ServerConfig
    from swarmlm.errors import InvalidRequest
    from swarmlm.server.scheduler import Scheduler
    from swarmlm.server.service import ServerStats, SwarmService

    config = ServerConfig(model_dir=tiny_llama, blocks=BlockRange(0, 3))
    service = SwarmService(config, Stage(tiny_llama, BlockRange(0, 3)), Scheduler(1), ServerStats())
    try:
        assert service.checks.range(0, 3) == BlockRange(0, 3)
        moved = Stage(tiny_llama, BlockRange(3, 6))
        service.stage = moved  # as Server._move does
        assert service.checks.range(3, 6) == BlockRange(3, 6) and service.training.stage is moved
        with pytest.raises(InvalidRequest, match="not inside"):
            service.checks.range(0, 3)
    finally:
        service.scheduler.stop()

def test_row_chunks_and_adapter_names_in_records():
    from swarmlm.client.training_forward import row_chunks
    from swarmlm.server.adapters import adapter_name
    from swarmlm.swarm.records import ServerRecord

    assert row_chunks(5, 128, 256) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert row_chunks(3, 4096, 2048) == [slice(0, 1), slice(1, 2), slice(2, 3)]  # a row is never split
    base = dict(server_id="x", address="127.0.0.1:1", start=0, end=2)
    assert ServerRecord.from_dict({**base, "adapters": "a,b-1"}).adapter_names == ("a", "b-1")
    assert ServerRecord.from_dict(base).adapter_names == ()
    for bad in ("a,,b", "../x", "a" * 65, ",".join(["abc"] * 400)):
        with pytest.raises(ValueError):
            ServerRecord.from_dict({**base, "adapters": bad})
    assert adapter_name("/some/dir/my-adapter") == "my-adapter"
    with pytest.raises(ValueError):
        adapter_name("/x/bad name")
