"""A decode step's path makes no torch call it does not need: each costs ~20-60 us right after a forward or a sleep
(docs/RESULTS-hop.md round 11). Same answers as the torch calls they replace."""
from __future__ import annotations

import itertools

import pytest
import torch

from swarmlm.client.model import checked_ids
from swarmlm.errors import InvalidRequest
from swarmlm.model.packed import PackedEmbedding, packed_from_numpy
from swarmlm.small_reads import SMALL_VALUES, all_set, id_bounds, no_padding_mask
from swarmlm.types import BlockRange
from swarmlm.wire import codec
from swarmlm.wire import swarm_pb2 as pb
from tests.swarm_helpers import RawStream, in_process_server
from tests.test_packed import raw_blocks

H = 64  # tiny-bloom hidden size


def test_all_set_answers_as_mask_all_for_every_shape_and_dtype():
    torch.manual_seed(0)
    shapes = [(1, 1), (1, 7), (3, 2), (4, 16), (1, SMALL_VALUES), (2, SMALL_VALUES), (1, 300), (5,), (2, 2, 2)]
    for shape, dtype in itertools.product(shapes, (torch.long, torch.int32, torch.bool)):
        ones = torch.ones(shape, dtype=dtype)
        assert all_set(ones)
        for _ in range(5):
            mask = (torch.rand(shape) > 0.2).to(dtype)
            assert all_set(mask) == bool(mask.all()), (shape, dtype, mask)
        padded = ones.clone()
        padded.view(-1)[-1] = 0
        assert not all_set(padded), (shape, dtype)


def test_a_decode_steps_mask_is_checked_without_a_torch_reduction(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("a torch reduction on a decode step's mask")

    monkeypatch.setattr(torch.Tensor, "all", refused)
    assert all_set(torch.ones(1, 1, dtype=torch.long))
    assert not all_set(torch.tensor([[1], [0]]))  # a batch of 2, one row padded


def test_id_bounds_answer_as_min_and_max_for_every_size_and_dtype():
    torch.manual_seed(0)
    for shape, dtype in itertools.product([(1,), (1, 1), (3, 5), (1, SMALL_VALUES), (2, SMALL_VALUES), (700,)],
                                          (torch.long, torch.int32)):
        ids = torch.randint(-5, 1000, shape, dtype=dtype)
        assert id_bounds(ids) == (int(ids.min()), int(ids.max())), (shape, dtype)


def test_a_decode_tokens_embedding_and_id_check_run_without_torch_reductions_or_unique(monkeypatch):
    packed = packed_from_numpy("Q8_0", raw_blocks("Q8_0", 100, 64), 64)
    table = packed.dequantize()
    for scale in (None, 2.0):
        embedding = PackedEmbedding(packed, scale=scale)
        want = [embedding(torch.tensor([[t, 0]]))[:, :1] for t in (0, 37, 99)]  # (the many-token path)
        with monkeypatch.context() as refusing:
            for name in ("min", "max", "aminmax"):
                refusing.setattr(torch.Tensor, name, _refused)
            refusing.setattr(torch, "unique", _refused)
            refusing.setattr(torch, "aminmax", _refused)
            for t, row in zip((0, 37, 99), want):
                ids = torch.tensor([[t]])
                got = embedding(checked_ids(ids, 100))
                assert torch.equal(got, row) and torch.equal(got[0, 0], table[t] * (scale or 1.0))
            for bad in (-1, 100):
                with pytest.raises(InvalidRequest, match=r"token ids must be in \[0, 100\)"):
                    checked_ids(torch.tensor([[bad]]), 100)
                with pytest.raises(IndexError, match="out of range"):
                    embedding(torch.tensor([[bad]]))


def _refused(*args, **kwargs):
    raise AssertionError("a torch reduction or unique on a decode step's ids")


@pytest.fixture(scope="module")
def server(tiny_bloom):
    with in_process_server(tiny_bloom, BlockRange(0, 2)) as server:
        yield server


def test_a_decode_step_reaches_the_scheduler_as_decoded_and_a_long_prompt_in_slices(server, monkeypatch):
    scheduler = server.service.scheduler
    seen: list[tuple[int, bool]] = []  # per forward submitted: its tokens, and whether its hidden is a view
    submit = scheduler.submit_step

    async def recording(stage, state, hidden, mask, op=None):
        seen.append((hidden.shape[1], hidden._base is not None or mask._base is not None))
        return await submit(stage, state, hidden, mask, op)

    monkeypatch.setattr(scheduler, "submit_step", recording)
    size = server.config.scheduler.max_batch_tokens
    stream, opened = RawStream.open(server.address, 0, 2, max_length=size + 8)
    try:
        prompt = stream.send(pb.InferenceRequest(step=pb.InferenceStep(
            hidden=codec.encode(torch.randn(1, size + 3, H)), step_id=1)))
        step = stream.send(pb.InferenceRequest(step=pb.InferenceStep(
            hidden=codec.encode(torch.randn(1, 1, H)), step_id=2)))
    finally:
        stream.end()
    assert not prompt.HasField("error") and not step.HasField("error") and step.position == size + 4
    assert seen == [(size, True), (3, True), (1, False)]


def test_a_framed_decode_step_makes_none_of_the_calls_round_15_took_off_its_server_path(server, monkeypatch):
    """A framed decode step on the server (inline on its loop, from the frame's bytes to its reply written) goes
    through no concurrent Future, asyncio Queue or timeout and no threading Condition, and makes no torch.ones for
    its mask (each call costs ~10x its warm time right after a forward: docs/RESULTS-hop.md round 15); the mask it
    computes with is the kept all-ones tensor, still all ones after the steps."""
    import socket
    import sys

    from swarmlm.bench.frame_attacks import END, HELLO, frame_port, open_request
    from swarmlm.wire import frames
    from swarmlm.wire.frames import Kind

    stage, scheduler = server.service.stage, server.service.scheduler
    inner, inline_before = stage.step_batch, scheduler.inline_runs
    masks, seen, forwards = [], set(), 0

    def profile(frame, event, arg) -> None:
        if event == "call":
            seen.add(frame.f_code.co_filename)
        elif event == "c_call":
            seen.add(getattr(arg, "__name__", ""))

    def step_batch(requests):  # the model's own calls are not counted: from the 3rd forward's end to the 8th's start
        nonlocal forwards
        forwards += 1
        masks.append(requests[0].mask)
        sys.setprofile(None)
        try:
            return inner(requests)
        finally:
            if 3 <= forwards < 8:
                sys.setprofile(profile)

    monkeypatch.setattr(stage, "step_batch", step_batch)
    buf = bytearray()

    def reply(sock) -> tuple[Kind, bytes]:
        while (got := frames.parse_frame(buf, 1 << 24)) is None:
            buf.extend(sock.recv(1 << 16))
        return got

    with socket.create_connection(("127.0.0.1", frame_port(server.address)), timeout=60) as sock:
        sock.sendall(HELLO + open_request(2))
        assert reply(sock)[0] == Kind.REPLY
        for step_id in range(1, 9):
            request = pb.InferenceRequest(step=pb.InferenceStep(hidden=codec.encode(torch.randn(1, 1, H)),
                                                                step_id=step_id))
            sock.sendall(frames.frame(Kind.REQUEST, request.SerializeToString()))
            kind, body = reply(sock)
            assert kind == Kind.REPLY and pb.InferenceReply.FromString(body).position == step_id
        sock.sendall(END)
        assert reply(sock)[0] == Kind.STATUS
    assert forwards == 8 and scheduler.inline_runs - inline_before >= 5  # (steps 4-7 inline on the loop)
    dropped = ("concurrent/futures/_base.py", "asyncio/queues.py", "asyncio/timeouts.py", "threading.py")
    assert not [f for f in seen if f.endswith(dropped)], sorted(seen)
    assert "ones" not in seen and "SerializeToString" in seen  # (the profile saw the C calls too)
    assert all(mask is no_padding_mask(1, 1) for mask in masks) and torch.equal(masks[0], torch.ones(1, 1).long())
