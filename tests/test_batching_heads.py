"""The client's LM head shared by concurrent sessions of one process (swarmlm/client/head_batcher.py): each caller
gets what the head gives it alone, a lone session never waits, closed sessions are not waited for; 4 concurrent
generate() calls through a real server give transformers' own tokens (tiny BLOOM and Llama)."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import AutoTokenizer

from swarmlm.client.head_batcher import HeadBatcher
from swarmlm.client.model import lm_head
from swarmlm.config import StragglerWait
from swarmlm.model.checkpoint import load_config
from swarmlm.types import BlockRange
from tests.swarm_helpers import reference_model, run_in_threads, running_swarm

FOREVER = StragglerWait(fraction=1e9, max_s=1e6)  # a wait that only an arrival (or a close) ends


class Session:
    closed = False


def _head() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 300, bias=False)).eval().requires_grad_(False)


def test_concurrent_callers_share_one_batch_and_get_their_own_rows():
    head = _head()
    batcher = HeadBatcher(head, FOREVER)
    sessions = [Session() for _ in range(4)]
    xs = [[torch.randn(1, 1 + i % 2, 16) for _ in range(6)] for i in range(4)]  # rows of 1 and 2 tokens
    got: dict[tuple[int, int], torch.Tensor] = {}
    barrier = threading.Barrier(4)

    def run(i: int) -> None:
        barrier.wait()
        for k, x in enumerate(xs[i]):
            got[i, k] = batcher(sessions[i], x)
            time.sleep(0.002)  # the step through the servers: the other threads' calls come in meanwhile
        sessions[i].closed = True  # as generate() closes its session: the others stop waiting for it

    run_in_threads(run, 4, 60)
    for (i, k), out in got.items():
        want = head(xs[i][k])
        assert out.shape == want.shape
        assert (out - want).abs().max().item() < 1e-5
        # the same token wherever the top two logits are apart by more than the float rounding of batching (the
        # matmul of 4 rows and of 1 may round differently: no CPU kernel promises the same bits across shapes)
        top2 = want.topk(2, dim=-1).values
        clear = top2[..., 0] - top2[..., 1] > 1e-4
        assert torch.equal(out.argmax(-1)[clear], want.argmax(-1)[clear])
    # once every session has been seen, a batch waits for all of them: after the first rounds, batches of 4
    assert batcher.batch_sizes[4] >= 1, batcher.batch_sizes


def test_a_lone_session_never_waits_and_a_closed_one_is_not_waited_for():
    head = _head()
    batcher = HeadBatcher(head, StragglerWait(fraction=1e9, max_s=0.5))
    a, b = Session(), Session()
    done = []

    def run(i: int) -> None:
        for _ in range(4):  # both sessions become expected by every batch
            done.append(batcher((a, b)[i], torch.randn(1, 1, 16)))
            time.sleep(0.002)

    run_in_threads(run, 2, 60)
    assert max(batcher.batch_sizes) == 2, batcher.batch_sizes
    batcher.max_wait_s = 1e6  # from now on only an arrival or a close ends a wait
    a.closed = True  # as generate() closes its session when it ends
    run_in_threads(lambda i: done.append(batcher(b, torch.randn(1, 1, 16))), 1, 60)  # a wait for `a` would never end
    lone = HeadBatcher(head, FOREVER)
    s = Session()
    run_in_threads(lambda i: [done.append(lone(s, torch.randn(2, 1, 16))) for _ in range(3)], 1, 60)
    assert len(done) == 12 and set(lone.batch_sizes) == {1}


def test_an_error_reaches_every_caller_of_the_batch_and_the_batcher_goes_on():
    def head(x: torch.Tensor) -> torch.Tensor:
        if x.isnan().any():
            raise ValueError("not a number")
        return x * 2

    batcher = HeadBatcher(head, FOREVER)
    sessions = [Session(), Session()]
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def run(i: int) -> None:
        barrier.wait()
        try:
            batcher(sessions[i], torch.full((1, 1, 16), float("nan")) if i else torch.randn(1, 1, 16))
        except ValueError as exc:
            errors.append(exc)
        finally:
            sessions[i].closed = True

    run_in_threads(run, 2, 60)
    assert len(errors) in (1, 2)  # in one batch both fail; apart, only the bad one
    x = torch.randn(1, 1, 16)
    assert torch.equal(batcher(Session(), x), x * 2)


@torch.inference_mode()
def test_lm_head_as_weight_times_rows_equals_the_linear():
    linear = torch.nn.Linear(64, 1000, bias=True)
    for shape in [(1, 1, 64), (8, 64), (3, 2, 64)]:
        x = torch.randn(*shape)
        got, want = lm_head(linear, x), linear(x)
        assert got.shape == want.shape and (got - want).abs().max().item() < 1e-5


# ---- through a real server ----------------------------------------------------------------------------------------
PROMPTS = ["one two three", "the sky is blue", "a", "write a short poem about the sea", "hello there"]


@pytest.fixture(scope="module", params=["bloom", "llama"])
def swarm(request, checkpoints):
    path = checkpoints[request.param]
    # a head batch waits (up to 30 s) for every session recently seen: batching is certain, not up to timing
    with running_swarm(path, [BlockRange(0, int(load_config(path).num_hidden_layers))], dht=False,
                       routing="shortest", head_batch_wait=StragglerWait(1e9, 30)) as (_, client):
        yield path, client, reference_model(path)


@pytest.mark.slow
def test_concurrent_generations_share_heads_and_give_transformers_tokens(swarm):
    path, client, ref = swarm
    tok = AutoTokenizer.from_pretrained(path)
    ids = [tok(p, return_tensors="pt").input_ids for p in PROMPTS]
    with torch.no_grad():
        want = [ref.generate(x, max_new_tokens=10, do_sample=False) for x in ids]
    before = sum(n for size, n in client.head_batcher.batch_sizes.items() if size > 1)
    got: list = [None] * len(PROMPTS)
    barrier = threading.Barrier(len(PROMPTS))

    def run(i: int) -> None:
        barrier.wait()
        got[i] = client.generate(ids[i], max_new_tokens=10)

    run_in_threads(run, len(PROMPTS))
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    shared = sum(n for size, n in client.head_batcher.batch_sizes.items() if size > 1)
    assert shared > before, client.head_batcher.batch_sizes  # heads of several sessions ran as one
    # one after another: each alone (a finished session is closed, so nobody waits for it)
    for x, w in zip(ids[:2], want):
        assert torch.equal(client.generate(x, max_new_tokens=10), w)
