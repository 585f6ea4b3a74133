"""Compact decode frames (wire/compact.py, docs/PROTOCOL.md "Framed steps"): a plain decode step of a keyed framed
session goes as a STEP and is answered by an ANSWER, with the same tokens as the protobuf path; every hostile STEP
gets one clear answer and the server goes on serving its other sessions."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from swarmlm.bench import frame_attacks as fa
from swarmlm.types import BlockRange
from swarmlm.wire import compact
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire.frames import HEADER
from swarmlm.wire.session_keys import MAC_BYTES
from tests.swarm_helpers import client_of, greedy_reference, in_process_server, in_process_swarm

HIDDEN = 64  # tiny-bloom's


class _Counted:
    """Counts the calls of a module function (the test's own spy, put back on exit)."""

    def __init__(self, monkeypatch, module, name: str) -> None:
        self.calls = 0
        real = getattr(module, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)


@pytest.mark.parametrize("from_the_loop", [False, True])
def test_plain_decode_steps_go_compact_and_equal_the_protobuf_path(tiny_bloom, monkeypatch, from_the_loop):
    """Framed, relayed through 2 servers: every decode step is a STEP answered by an ANSWER on both hops (the
    prefill and the open stay protobuf), and the greedy tokens equal transformers' and a gRPC client's; from the
    caller's thread (`send_blocking`) or, with that path off, from the client's event loop (`send`)."""
    if from_the_loop:
        from swarmlm.client.streams import SpanStream
        monkeypatch.setattr(SpanStream, "blocking_ok", property(lambda self: False))
    ids, want = greedy_reference(tiny_bloom, "compact frames both ways", 6)
    steps = _Counted(monkeypatch, compact, "step_frame")
    answers = _Counted(monkeypatch, compact, "answer_frame")
    with in_process_swarm(tiny_bloom, [BlockRange(0, 3), BlockRange(3, 6)]) as swarm:
        got = {}
        for framed in (True, False):
            client = client_of(swarm, frames=framed, push=False)
            try:
                before = steps.calls
                with torch.no_grad(), client.inference_session(max_length=ids.shape[1] + 8) as session:
                    logits = client.step_logits(session, ids)
                    tokens = [int(logits[0, -1].argmax())]
                    for _ in range(5):
                        logits = client.step_logits(session, torch.tensor([[tokens[-1]]]))
                        tokens.append(int(logits[0, -1].argmax()))
                # (a relayed decode step's STEPs are built in C by the chain, client/relay.py: counted there)
                in_c = session._relay.answered if session._relay is not None else 0
                got[framed] = (tokens, steps.calls - before + in_c)
                assert all(step.blocking is (framed and not from_the_loop) for step in session.steps[1:])
            finally:
                client.close()
    assert got[True][0] == want and got[False][0] == want
    assert got[True][1] == 5 * 2, "every decode step, on both hops, is a compact STEP"
    lane = sum(s.service.scheduler.lane_steps for s in swarm.servers)  # (ANSWERs the step lane wrote: server/lane.py)
    assert answers.calls + lane == 5 * 2, "and every one was answered by an ANSWER"
    assert got[False][1] == 0, "a gRPC stream never writes a STEP"


def _keyed_server(tiny_bloom, **settings):
    return in_process_server(tiny_bloom, BlockRange(0, 2), session_idle_timeout_s=20.0, open_idle_timeout_s=20.0,
                             max_batch=2, **settings)


def _values(b: int = 1, t: int = 1) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((b, t, HIDDEN), dtype=np.float32)


def test_a_step_answer_carries_the_same_output_as_a_protobuf_reply(tiny_bloom):
    """The same keyed session state, stepped once by a REQUEST and once by a STEP of the same values (two sessions
    from the same prefill): the ANSWER's values equal the REPLY's, its MAC checks under the server key and no other
    (the protobuf MAC's domain is not the ANSWER's)."""
    with _keyed_server(tiny_bloom) as server:
        outs = []
        for use_compact in (False, True):
            with fa.KeyedStream(server.address, blocks=2) as stream:
                stream.request(_values(1, 3), step_id=1)
                outs.append(stream.request(_values(), step_id=2) if not use_compact else
                            stream.step(_values(), step_id=2))
        reply, answer = outs
        assert isinstance(reply, pb.InferenceReply) and isinstance(answer, compact.Answer)
        assert answer.step_id == 2 and answer.position == 4 and answer.compute_s > 0
        assert bytes(answer.data()) == reply.hidden.data


def test_hostile_steps_get_one_clear_answer_each_and_the_server_goes_on(tiny_bloom):
    """Every hostile STEP (swarmlm/bench/frame_attacks.py `compact_cases`) is refused as its case expects: a
    tampered or MAC-less one closes its session (PERMISSION_DENIED, as a tampered protobuf step), one with bad dims
    or values is refused by a REPLY with its error (the session goes on), one out of place breaks its stream; and a
    session opened before them all still steps."""
    with _keyed_server(tiny_bloom) as server:
        with fa.KeyedStream(server.address, blocks=2) as bystander:
            bystander.step(_values(), step_id=1)
            results = fa.run_compact_cases(server.address, HIDDEN, blocks=2, max_batch=2)
            answer = bystander.step(_values(), step_id=2)
            assert isinstance(answer, compact.Answer) and answer.position == 2
        bad = {name: got for name, got in results.items() if not fa.compact_expected(name, got)}
        assert not bad, bad
        assert server.service.load.held == {}  # every step's bytes released


def test_a_replayed_step_is_not_run_twice(tiny_bloom):
    """A STEP sent again with its id (a copy of a step already taken: StepOrder's duplicate, as a pushed copy's) is
    dropped: the session does not advance, and the next step is answered in turn."""
    with _keyed_server(tiny_bloom) as server, fa.KeyedStream(server.address, blocks=2) as stream:
        first = stream.step_frame(_values(), step_id=1)
        stream.send(first)
        assert stream.answer().position == 1
        stream.send(first)  # the same frame again
        answer = stream.step(_values(), step_id=2)
        assert isinstance(answer, compact.Answer) and answer.step_id == 2 and answer.position == 2


def test_an_answer_that_was_changed_is_the_servers_failure():
    """The client's check of an ANSWER: a changed byte anywhere, a cut, or a MAC under another key or domain (the
    STEP's, a protobuf message's) is `Tampered`; a length other than the step's is InvalidRequest."""
    key, other, sid = b"k" * 32, b"o" * 32, "s" * 32
    values = _values().tobytes()
    good = compact.answer_frame(key, sid, 3, 7, values, 0.0, 0.001, 0.0, 0.0, 1)[HEADER.size:]
    assert compact.Answer(good).opened(key, sid, HIDDEN).position == 7
    changed = bytearray(good)
    changed[40] ^= 1
    step = compact.step_frame(key, sid, 3, 1, 1, HIDDEN, values)[HEADER.size:]
    for bad in (bytes(changed), good[:-1], good[:10],
                compact.answer_frame(other, sid, 3, 7, values, 0.0, 0.0, 0.0, 0.0, 1)[HEADER.size:],
                compact.answer_frame(key, "t" * 32, 3, 7, values, 0.0, 0.0, 0.0, 0.0, 1)[HEADER.size:], step):
        with pytest.raises(compact.Tampered):
            compact.Answer(bad).opened(key, sid, HIDDEN)
    from swarmlm.errors import InvalidRequest
    with pytest.raises(InvalidRequest, match="value bytes"):
        compact.Answer(good).opened(key, sid, HIDDEN * 2)
    # a STEP's MAC is not a protobuf message's over the same bytes (BLAKE2b personalised: wire/compact.py)
    from swarmlm.wire.session_keys import _mac_of
    assert step[-MAC_BYTES:] != _mac_of(key, sid, step[:-MAC_BYTES])


def test_a_tensors_values_go_into_a_frame_without_a_bytes_copy_first():
    """`float32_values`: a float32 C-ordered tensor's own memory (no copy made before the frame copies it); any other
    tensor (another dtype, not contiguous, wanting gradients) as C-ordered float32 of the same values. Frames built
    from it equal frames built from the values' bytes, and their declared length counts bytes, not rows."""
    key, sid = b"k" * 32, "s" * 32
    plain = torch.randn(1, 1, HIDDEN)
    values = compact.float32_values(plain)
    assert np.shares_memory(values, plain.numpy()) and values.nbytes == 4 * HIDDEN
    raw = plain.numpy().tobytes()
    assert compact.answer_frame(key, sid, 3, 7, values, 0.0, 0.001, 0.0, 0.0, 1) == \
        compact.answer_frame(key, sid, 3, 7, raw, 0.0, 0.001, 0.0, 0.0, 1)
    assert compact.step_frame(key, sid, 3, 1, 1, HIDDEN, values) == compact.step_frame(key, sid, 3, 1, 1, HIDDEN, raw)
    answer = compact.answer_frame(key, sid, 3, 7, values, 0.0, 0.001, 0.0, 0.0, 1)[HEADER.size:]
    assert bytes(compact.Answer(answer).opened(key, sid, HIDDEN).data()) == raw
    others = (torch.randn(1, HIDDEN, 2).transpose(1, 2)[:, :1],  # a view, not contiguous
              torch.randn(1, 1, HIDDEN, dtype=torch.bfloat16), torch.randn(1, 1, HIDDEN, requires_grad=True))
    for tensor in others:
        got = compact.float32_values(tensor)
        assert got.dtype == np.float32 and got.flags.c_contiguous
        assert got.tobytes() == tensor.detach().float().contiguous().numpy().tobytes()
