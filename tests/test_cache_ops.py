"""Cache operations on a server's stage (types.CacheOp), every family in one process: a session whose cache is
truncated, reordered and copied gives the outputs of a fresh session fed the same (edited) inputs; a batch that
mixes sessions with and without ops changes only what each op names; memory stays inside the reservation."""
from __future__ import annotations

import pytest
import torch

from swarmlm.model.random_checkpoint import init_checkpoint
from swarmlm.server.stage import Stage, StepRequest
from swarmlm.types import BlockRange, CacheOp

torch.set_num_threads(1)
FAMILIES = ["tiny-bloom", "tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-mixtral", "tiny-falcon",
            "tiny-gemma2"]
ATOL = 1e-5


@pytest.fixture(scope="module", params=FAMILIES)
def stage(request, tmp_path_factory) -> Stage:
    path = init_checkpoint(request.param, tmp_path_factory.mktemp(request.param), seed=5)
    return Stage(str(path), BlockRange(1, 3))


def inputs(stage: Stage, rows: int, tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, tokens, stage.hidden_size, generator=torch.Generator().manual_seed(seed))


def ones(x: torch.Tensor) -> torch.Tensor:
    return torch.ones(x.shape[:2], dtype=torch.long)


def fresh_run(stage: Stage, history: torch.Tensor, mask: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The new step's output in a session that was only ever fed `history` (no op)."""
    state = stage.new_state(stage.blocks, history.shape[0], 64)
    stage.step(state, history, mask)
    return stage.step(state, new, ones(new))


def test_truncate_and_reorder_equal_a_session_fed_the_edited_inputs(stage):
    # 12 prompt tokens + decodes: past tiny-mistral's / qwen2's / gemma2's 8-token sliding windows
    prompt, d1, d2 = inputs(stage, 3, 12, 0), inputs(stage, 3, 3, 1), inputs(stage, 3, 1, 2)
    mask = ones(prompt)
    mask[1, :2] = 0  # row 1 left-padded: positions come from the mask, after the op too
    state = stage.new_state(stage.blocks, 4, 64)  # reserved for 4 rows
    stage.step(state, prompt, mask)
    stage.step(state, d1, ones(d1))  # 3 draft tokens...
    op = CacheOp(truncate_to=13, rows=(2, 1, 1, 0))  # ...2 rejected; rows reordered and one copied (3 -> 4 rows)
    out = stage.step(state, d2[[2, 1, 1, 0]], ones(d2[[2, 1, 1, 0]]), op)
    assert state.position == 14 and state.rows == 4
    history = torch.cat([prompt, d1[:, :1]], 1)[[2, 1, 1, 0]]
    hmask = torch.cat([mask, ones(d1[:, :1])], 1)[[2, 1, 1, 0]]
    want = fresh_run(stage, history, hmask, d2[[2, 1, 1, 0]])
    assert (out - want).abs().max().item() < ATOL
    # and the session goes on from there: a multi-token step after a truncation to 10, rows narrowed to 2
    more = inputs(stage, 2, 3, 3)
    out = stage.step(state, more, ones(more), CacheOp(truncate_to=10, rows=(3, 0)))
    history2 = history[[3, 0], :10]
    want = fresh_run(stage, history2, hmask[[3, 0], :10], more)
    assert (out - want).abs().max().item() < ATOL
    assert state.position == 13 and state.rows == 2


def test_a_batch_of_sessions_applies_each_op_to_its_own_session_only(stage):
    a_in, b_in = inputs(stage, 2, 5, 10), inputs(stage, 1, 5, 11)
    a, b = stage.new_state(stage.blocks, 2, 32), stage.new_state(stage.blocks, 1, 32)
    stage.step(a, a_in, ones(a_in))
    stage.step(b, b_in, ones(b_in))
    b_keys = b.cache.keys[:, :, :, :5].clone()
    na, nb = inputs(stage, 2, 1, 12), inputs(stage, 1, 1, 13)
    outs = stage.step_batch([StepRequest(a, na, ones(na), CacheOp(truncate_to=3, rows=(1, 0))),
                             StepRequest(b, nb, ones(nb))])
    assert torch.equal(b.cache.keys[:, :, :, :5], b_keys) and b.position == 6 and a.position == 4
    assert (outs[0] - fresh_run(stage, a_in[[1, 0], :3], ones(a_in[:, :3]), na)).abs().max().item() < ATOL
    assert (outs[1] - fresh_run(stage, b_in, ones(b_in), nb)).abs().max().item() < ATOL


def test_a_failed_forward_leaves_the_session_as_it_was(stage, monkeypatch):
    x = inputs(stage, 2, 4, 20)
    state = stage.new_state(stage.blocks, 2, 32)
    stage.step(state, x, ones(x))
    cache, mask = state.cache, state.mask.clone()

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(stage.adapter, "forward_span", broken)
    with pytest.raises(RuntimeError):
        stage.step(state, x[:, :1], ones(x[:, :1]), CacheOp(rows=(1, 1)))
    assert state.cache is cache and torch.equal(state.mask, mask) and state.rows == 2


def test_buffers_stay_inside_the_reservation(stage):
    """An empty session takes any rows up to its reservation; copies grow it within the reserved bytes."""
    state = stage.new_state(stage.blocks, 3, 16)
    x = inputs(stage, 1, 6, 30)
    stage.step(state, x, ones(x))  # one prompt row...
    y = inputs(stage, 3, 1, 31)
    stage.step(state, y, ones(y), CacheOp(rows=(0, 0, 0)))  # ...shared by 3 sequences
    for _ in range(9):
        stage.step(state, y, ones(y))
    assert state.position == 16 and state.rows == 3
    held = state.cache.keys.numel() * state.cache.keys.element_size() * 2
    assert held <= stage.cache_bytes(stage.blocks.length, 3, 16)


# ---- on the wire, through servers (in this process: the protocol) ---------------------------------------------
H = 64  # tiny-bloom's hidden size
A, B = BlockRange(0, 2), BlockRange(2, 4)


@pytest.fixture(scope="module")
def two_servers(tiny_bloom):
    from tests.swarm_helpers import in_process_server

    with in_process_server(tiny_bloom, A) as a, in_process_server(tiny_bloom, B) as b:
        yield a.address, b.address


def _step(hidden: torch.Tensor, op: CacheOp | None = None, step_id: int = 0, push=()):
    from swarmlm.wire import cache_op, codec
    from swarmlm.wire import swarm_pb2 as pb

    return pb.InferenceRequest(step=pb.InferenceStep(hidden=codec.encode(hidden), step_id=step_id, push=push,
                                                     cache_op=cache_op.to_wire(op)))


def _hidden(msg) -> torch.Tensor:
    from swarmlm.wire import codec

    return codec.decode(msg, "hidden")


def test_bad_ops_are_refused_and_touch_no_session(two_servers):
    from swarmlm.wire import swarm_pb2 as pb
    from tests.swarm_helpers import RawStream, stub

    address = two_servers[0]
    x, other_in = torch.randn(2, 5, H), torch.randn(1, 4, H)
    (s, _), (other, _) = RawStream.open(address, A.start, A.end, batch=2), RawStream.open(address, A.start, A.end)
    assert not s.send(_step(x)).HasField("error")
    other.send(_step(other_in))
    bad = {
        "truncate_to 6 is past the 5 tokens": _step(x[:, :1], CacheOp(truncate_to=6)),
        "row 2 is out of range": _step(x[:, :1], CacheOp(rows=(0, 2))),
        "3 rows exceed the batch of 2 reserved": _step(torch.randn(3, 1, H), CacheOp(rows=(0, 1, 0))),
        "batch 2 does not match the session's batch 1": _step(x[:, :1], CacheOp(rows=(1,))),
        "rows of a session that holds no tokens": _step(x[:, :1], CacheOp(truncate_to=0, rows=(1, 0))),
        "exceed the limit": _step(x[:, :1], CacheOp(rows=tuple([0] * 65))),
        "would exceed the max_length": _step(torch.randn(2, 30, H), CacheOp(truncate_to=3)),
    }
    for needle, request in bad.items():
        reply = s.send(request)
        assert reply.HasField("error") and needle in reply.error.message, (needle, reply.error.message)
        assert reply.position == 5
    # the session is intact, and a good op edits exactly it: truncate to 3, swap the rows, one more token
    y = torch.randn(2, 1, H)
    good = s.send(_step(y, CacheOp(truncate_to=3, rows=(1, 0))))
    assert not good.HasField("error") and good.position == 4
    plain = stub(address).Forward(pb.ForwardRequest(
        start_block=A.start, end_block=A.end, hidden=_step(torch.cat([x[[1, 0], :3], y], 1)).step.hidden))
    assert (_hidden(good.hidden) - _hidden(plain.hidden)[:, -1:]).abs().max().item() < 1e-5
    # the other session on the same server never saw any of it
    z = torch.randn(1, 1, H)
    after = other.send(_step(z))
    assert after.position == 5
    alone = stub(address).Forward(pb.ForwardRequest(
        start_block=A.start, end_block=A.end, hidden=_step(torch.cat([other_in, z], 1)).step.hidden))
    assert (_hidden(after.hidden) - _hidden(alone.hidden)[:, -1:]).abs().max().item() < 1e-5
    s.end()
    other.end()


def test_a_pushed_step_carries_its_op_to_the_next_server(two_servers):
    from swarmlm.wire import swarm_pb2 as pb
    from tests.swarm_helpers import RawStream, stub

    a, b = two_servers
    (call_a, _), (call_b, opened_b) = RawStream.open(a, A.start, A.end, 3), RawStream.open(b, B.start, B.end, 3)
    x = torch.randn(1, 6, H)
    ra1 = call_a.send(_step(x, step_id=1))
    call_b.send(_step(_hidden(ra1.hidden), step_id=1))
    # one prompt row becomes 3 sequences, the last 2 tokens rolled back; A pushes the op on with its output
    y = torch.randn(3, 2, H)
    target = pb.PushTarget(address=b, session_id=opened_b.session_id, step_id=2, secret=opened_b.session_secret)
    op = CacheOp(truncate_to=4, rows=(0, 0, 0))
    ra2 = call_a.send(_step(y, op, step_id=2, push=[target]))
    rb2 = call_b.read()
    assert ra2.pushed and not rb2.HasField("error") and rb2.position == ra2.position == 6
    whole = torch.cat([x[[0, 0, 0], :4], y], 1)
    mid = stub(a).Forward(pb.ForwardRequest(start_block=A.start, end_block=A.end, hidden=_step(whole).step.hidden))
    end = stub(b).Forward(pb.ForwardRequest(start_block=B.start, end_block=B.end, hidden=mid.hidden))
    assert (_hidden(rb2.hidden) - _hidden(end.hidden)[:, -2:]).abs().max().item() < 1e-5
    for call in (call_a, call_b):
        call.end()


# ---- the client's side, without a network ------------------------------------------------------------------------

def test_ops_compose_and_the_replay_history_follows_them():
    from swarmlm.client.pipeline import edited_history

    first, then = CacheOp(truncate_to=5, rows=(1, 0, 0)), CacheOp(truncate_to=7, rows=(2, 0))
    both = first.then(then)
    assert both == CacheOp(truncate_to=5, rows=(0, 1))  # new row 0 = old row (1, 0, 0)[2] = 0
    assert CacheOp(rows=(1, 0)).then(CacheOp(truncate_to=3)) == CacheOp(truncate_to=3, rows=(1, 0))
    history = [(torch.arange(2 * 4).reshape(2, 4, 1).float(), torch.ones(2, 4, dtype=torch.long)),
               (torch.arange(2 * 3).reshape(2, 3, 1).float() + 100, torch.ones(2, 3, dtype=torch.long))]
    whole = torch.cat([h for h, _ in history], 1)
    edited = edited_history(edited_history(history, first), then)
    assert torch.equal(torch.cat([h for h, _ in edited], 1), whole[[0, 1], :5])
    assert torch.equal(torch.cat([h for h, _ in edited_history(history, both)], 1), whole[[0, 1], :5])
    assert edited_history(history, CacheOp(truncate_to=0)) == []


def test_remote_cache_records_transformers_edits_as_one_pending_op():
    from types import SimpleNamespace

    from swarmlm.client.remote_cache import RemoteCache

    cache = RemoteCache(model=None, session=SimpleNamespace(position=10, rows=3, max_length=32))
    cache.reorder_cache(torch.tensor([2, 0, 0]))
    cache.crop(-3)  # transformers 5: a count of tokens to drop
    cache.crop(0)  # nothing
    assert cache.get_seq_length() == 7 and cache.rows == 3
    cache.batch_select_indices(torch.tensor([1, 2]))
    cache.batch_repeat_interleave(2)
    assert cache.rows == 4
    assert cache.take_pending() == CacheOp(truncate_to=7, rows=(0, 0, 0, 0))  # (2,0,0)[1]=0, [2]=0, each twice
    assert cache.take_pending() is None and cache.get_seq_length() == 10
    with pytest.raises(ValueError):
        cache.crop(4)  # transformers 5 refuses a positive count too
    with pytest.raises(ValueError, match="out of range"):
        cache.reorder_cache(torch.tensor([0, 3, 1]))
