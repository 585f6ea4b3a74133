"""The bounded-memory reference (one block held at a time, the head read in chunks) computes transformers' logits
and greedy tokens, on a safetensors checkpoint and on a Q4_0 GGUF written by the streaming writer."""
from __future__ import annotations

import pytest
import torch

from swarmlm.model.checkpoint import load_transformers_model
from swarmlm.model.random_checkpoint import init_checkpoint, init_gguf
from swarmlm.model.reference import BoundedReference

PROMPTS = [[5, 17, 42, 99, 7, 300], [1, 200, 33, 8, 64, 501]]
STEPS = 4


@torch.inference_mode()
def _transformers_greedy(model, prompts: list[list[int]], steps: int):
    ids, tokens, logits = torch.tensor(prompts), [], []
    for _ in range(steps):  # the whole sequence each step, as the reference does
        last = model(ids).logits[:, -1].float()
        logits.append(last)
        tokens.append(last.argmax(-1, keepdim=True))
        ids = torch.cat([ids, tokens[-1]], 1)
    generated = model.generate(torch.tensor(prompts), max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    assert torch.equal(generated[:, len(prompts[0]):], torch.cat(tokens, 1))  # and as generate() does
    return torch.cat(tokens, 1), torch.stack(logits)


@pytest.mark.parametrize("kind", ["safetensors", "gguf-q4_0"])
def test_the_bounded_reference_equals_transformers(tmp_path, kind):
    if kind == "safetensors":
        model = init_checkpoint("tiny-llama3", tmp_path / "ckpt", seed=3)
    else:
        model = init_gguf("tiny-llama", tmp_path / "tiny.q4_0.gguf", "q4_0", seed=3)
    want_tokens, want_logits = _transformers_greedy(load_transformers_model(model), PROMPTS, STEPS)
    reference = BoundedReference(model, head_rows=100)  # 512-token vocabulary: 6 chunks, the last one short
    got = reference.greedy(PROMPTS, STEPS)
    assert torch.equal(got.tokens, want_tokens)
    torch.testing.assert_close(got.logits, want_logits, rtol=1e-4, atol=1e-5)
    one_block = sum(v.nbytes for k, v in load_transformers_model(model).state_dict().items()
                    if k.startswith("model.layers.0."))
    assert reference.largest_block_bytes == one_block


def test_left_padded_prompts_match_one_by_one(tmp_path):
    model = init_gguf("tiny-llama", tmp_path / "tiny.q8_0.gguf", "q8_0", seed=4)
    reference = BoundedReference(model)
    short = [9, 10, 11]
    together = reference.greedy([PROMPTS[0], short], 3)
    alone = reference.greedy([short], 3)
    assert torch.equal(together.tokens[1:], alone.tokens)
    torch.testing.assert_close(together.logits[:, 1:], alone.logits, rtol=1e-4, atol=1e-5)
