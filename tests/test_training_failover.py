"""A server SIGKILLed between a training step's forward and its backward: the backward re-routes the dead server's
blocks, recomputes their forward on the new route and completes, with transformers' gradients."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from swarmlm.types import BlockRange
from tests.swarm_helpers import running_swarm

pytestmark = pytest.mark.slow
torch.set_num_threads(1)


def test_server_killed_between_forward_and_backward(tiny_llama):
    with running_swarm(tiny_llama, [BlockRange(0, 6), BlockRange(0, 3), BlockRange(3, 6)], dht=False,
                       dtype="float32", ban_base_s=30.0) as (swarm, model):
        ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
        ids = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(0))
        embeds = ref.get_input_embeddings()(ids).detach()
        x = embeds.clone().requires_grad_(True)
        out = model(inputs_embeds=x, labels=ids)
        used = {s.address for s in model.trainer.last_spans}
        victim = next(s for s in swarm.servers if s.address in used)
        swarm.kill(victim)  # SIGKILL: no goodbye, the backward's first call to it fails
        out.loss.backward()
        y = embeds.clone().requires_grad_(True)
        ref(inputs_embeds=y, labels=ids).loss.backward()
        assert not victim.alive
        assert ((x.grad - y.grad).norm() / y.grad.norm()).item() < 1e-4
