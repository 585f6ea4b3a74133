"""A trained model through the swarm: SmolLM2-135M-Instruct's GGUF given as --model to 2 server processes (each
keeps only its 15 blocks, in the file's own Q4_1 blocks) answers chat-templated questions with the tokens and
logits transformers gives when it loads (and dequantizes) the same GGUF file."""
from __future__ import annotations

import pytest
import torch

from swarmlm.model.checkpoint import load_tokenizer, load_transformers_model
from swarmlm.swarm.local import even_split
from swarmlm.types import BlockRange
from tests.swarm_helpers import running_swarm

pytestmark = pytest.mark.slow
QUESTIONS = ["What is the capital of France?", "Name a primary color."]
NUM_BLOCKS = 30


@pytest.fixture(scope="module")
def swarm(smollm2_gguf):
    torch.set_num_threads(1)
    with running_swarm(smollm2_gguf, even_split(NUM_BLOCKS, 2)) as (swarm, client):
        yield swarm, client, load_transformers_model(smollm2_gguf), load_tokenizer(smollm2_gguf)


def _chat(tokenizer, question: str) -> dict:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)


def test_greedy_chat_answers_are_transformers_own(swarm):
    _, client, ref, tokenizer = swarm
    for question in QUESTIONS:
        inputs = _chat(tokenizer, question)
        got = client.generate(**inputs, max_new_tokens=12, do_sample=False)
        with torch.inference_mode():
            want = ref.generate(**inputs, max_new_tokens=12, do_sample=False)
        assert torch.equal(got, want), (tokenizer.decode(got[0]), tokenizer.decode(want[0]))
    answer = tokenizer.decode(got[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert answer.strip(), "a trained model answers"


def test_logits_within_the_kernels_rounding_prefill_and_decode(swarm):
    """Q4_1 products round activations to int16 per block of 32 (kernels/act16.c): logits within 0.1 % (relative
    L2; ~0.015 % measured) of transformers' float32 product -- int8 activations (2.96 %) or bfloat16 (0.69 %) fail."""
    _, client, ref, tokenizer = swarm
    ids = _chat(tokenizer, QUESTIONS[0])["input_ids"]

    def close(got: torch.Tensor, want: torch.Tensor) -> bool:
        return float((got - want).norm() / want.norm()) < 1e-3

    with torch.inference_mode(), client.inference_session(max_length=ids.shape[1] + 4) as session:
        got = client.step_logits(session, ids)
        assert close(got, ref(ids).logits)
        for _ in range(4):
            ids = torch.cat([ids, got[:, -1:].argmax(-1)], 1)
            got = client.step_logits(session, ids[:, -1:])
            assert close(got, ref(ids).logits[:, -1:])


def _rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_server_holds_memory_for_its_blocks_not_the_file(swarm):
    """A server of 15 blocks against one of all 30, both from the same GGUF: the difference is about 15 blocks of
    the file's packed bytes (2.2 MB each held), far from the 15 x 14 MB they take dequantized."""
    from swarmlm.model.gguf import open_gguf

    local, _, ref, _ = swarm
    checkpoint = open_gguf(local.model_dir)
    block_bytes = sum(checkpoint.packed_bytes(k) for k in checkpoint.keys() if k.startswith("model.layers.0."))
    float_bytes = sum(v.nbytes for k, v in ref.state_dict().items() if k.startswith("model.layers.0."))
    # two fresh servers (the swarm's own have held sessions and prefix caches since)
    half = local.start_server(BlockRange(0, NUM_BLOCKS // 2))
    whole = local.start_server(BlockRange(0, NUM_BLOCKS))
    grew = _rss_bytes(whole.proc.pid) - _rss_bytes(half.proc.pid)
    assert 0.5 * 15 * block_bytes < grew < 0.5 * 15 * float_bytes, (grew, block_bytes, float_bytes)


def test_model_fetch_serves_the_gguf_itself(swarm):
    """`swarmlm model fetch` (cached per machine) prints the checked GGUF file: no float32 copy is written."""
    import subprocess
    import sys
    from pathlib import Path

    local = swarm[0]
    done = subprocess.run([sys.executable, "-m", "swarmlm.cli.main", "model", "fetch", "smollm2-135m-instruct"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == Path(local.model_dir).resolve() and done.stdout.strip().endswith(".gguf")
