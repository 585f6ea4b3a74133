"""A server's plain decode step of a packed span answered in one kernel call (kernels/lane.c: the STEP's values
checked finite, the span, the whole ANSWER frame; server/service.py `_answer_in_one_call`): taken for a lone
session's compact decode steps, its answers equal the usual path's bit for bit and carry a MAC the client checks, its
tokens are transformers' (relayed and pushed routes); a NaN is refused as before with nothing committed; a step of
two sessions that batch goes the usual way."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from swarmlm.bench import frame_attacks as fa
from swarmlm.kernels.frame_types import AnswerHead, FrameKey
from swarmlm.model.decode_span import SpanDecoder
from swarmlm.model.random_checkpoint import init_checkpoint
from swarmlm.server.stage import Stage
from swarmlm.small_reads import no_padding_mask
from swarmlm.types import BlockRange
from swarmlm.wire import compact
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire.frames import HEADER
from tests.gguf_fixtures import write_tiny_gguf
from tests.swarm_helpers import client_of, in_process_server, in_process_swarm, reference_model

NEW_TOKENS = 8
# the one-call answer is the usual path's: servers here have no step lane, which would take the later steps before
# the usual path sees them (server/lane.py; tests/test_step_lane.py)
NO_LANE = {"step_lane": False}


@pytest.fixture(scope="module")
def packed_llama(tmp_path_factory) -> str:
    """A tiny Llama as a GGUF with every matrix Q4_1 (SmolLM2's file type): its blocks run packed, one call a step."""
    root = tmp_path_factory.mktemp("one-call")
    checkpoint = init_checkpoint("tiny-llama", root / "checkpoint", seed=7)
    return str(write_tiny_gguf(checkpoint, root / "tiny-q4_1.gguf", matrix_type="Q4_1"))


@pytest.fixture
def one_call(monkeypatch) -> list[int]:
    """The rows of every step answered in one call (SpanDecoder.answer returned a frame), in this process."""
    calls, answer = [], SpanDecoder.answer

    def counted(self, body, rows, *args):
        frame = answer(self, body, rows, *args)
        if frame is not None:
            calls.append(rows)
        return frame

    monkeypatch.setattr(SpanDecoder, "answer", counted)
    return calls


def _hidden(path: str) -> int:
    return int(reference_model(path).config.hidden_size)


def _values(hidden: int, seed: int, t: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, t, hidden), dtype=np.float32)


def _stepped(address: str, blocks: int, hidden: int, nan_at: int | None = None) -> list:
    """A keyed framed session: a 3-token prefill (protobuf), then 6 decode STEPs of seeded values (and, before the
    STEP `nan_at`, one carrying a NaN). Returns every answer after the prefill."""
    answers = []
    with fa.KeyedStream(address, blocks=blocks, max_length=16) as stream:
        stream.request(_values(hidden, 0, t=3), step_id=1)
        step_id = 2
        for i in range(6):
            if i == nan_at:
                bad = _values(hidden, 99)
                bad[0, 0, 3] = np.nan
                answers.append(stream.step(bad, step_id=step_id))
                step_id += 1
            answers.append(stream.step(_values(hidden, 10 + i), step_id=step_id))
            step_id += 1
    return answers


def test_a_lone_sessions_steps_are_answered_in_one_call_as_the_usual_path_answers(packed_llama, one_call):
    """One server with the one-call answer, one without: the same session's decode STEPs get ANSWERs (their MACs
    checked under the server key) with the same values, position and step ids, bit for bit; the one-call server
    answered every one it ran inline (all but the first decode step, which runs on the compute thread: no decode
    round has shown the session alone yet) in one call, with its compute time in the header."""
    hidden, blocks = _hidden(packed_llama), reference_model(packed_llama).config.num_hidden_layers
    got = {}
    for on in (True, False):
        with in_process_server(packed_llama, BlockRange(0, blocks), one_call_steps=on, **NO_LANE) as server:
            before = len(one_call)
            got[on] = _stepped(server.address, blocks, hidden)
            got[on, "calls"] = len(one_call) - before
            got[on, "inline"] = server.service.scheduler.inline_runs
    assert got[True, "calls"] == 5 and got[False, "calls"] == 0
    assert got[True, "inline"] == got[False, "inline"] == 5  # the scheduler's accounting is the same
    for fast, usual in zip(got[True], got[False]):
        assert isinstance(fast, compact.Answer) and isinstance(usual, compact.Answer)
        assert (fast.step_id, fast.position, fast.batched_steps, fast.pushed) == \
            (usual.step_id, usual.position, usual.batched_steps, usual.pushed)
        assert bytes(fast.data()) == bytes(usual.data())
        assert fast.compute_s > 0 and fast.parse_s > 0 and fast.queued_s >= 0


def test_a_nan_is_refused_as_before_and_the_next_step_is_right(packed_llama, one_call):
    """A STEP with a NaN, where the one-call answer would run: refused by the same REPLY as the usual path's
    (nothing computed: not counted, the position unchanged), and the session's next STEPs answer exactly what a
    session that never saw it answers."""
    hidden, blocks = _hidden(packed_llama), reference_model(packed_llama).config.num_hidden_layers
    with in_process_server(packed_llama, BlockRange(0, blocks), **NO_LANE) as server:
        with_nan = _stepped(server.address, blocks, hidden, nan_at=3)
        counted_with_nan = len(one_call)
        inline_with_nan = server.service.scheduler.inline_runs
    with in_process_server(packed_llama, BlockRange(0, blocks), one_call_steps=False, **NO_LANE) as server:
        usual = _stepped(server.address, blocks, hidden, nan_at=3)
    refusal, refused = with_nan.pop(3), usual.pop(3)
    assert isinstance(refusal, pb.InferenceReply) and refusal.error.code == "INVALID_ARGUMENT"
    assert refusal.error.message == refused.error.message == "hidden: contains NaN or infinite values"
    assert refusal.position == with_nan[2].position  # nothing committed
    assert counted_with_nan == inline_with_nan == 5
    assert [bytes(a.data()) for a in with_nan] == [bytes(a.data()) for a in usual]
    assert [a.position for a in with_nan] == [a.position for a in usual] == list(range(4, 10))


def test_two_sessions_that_batch_go_the_usual_way(packed_llama, one_call):
    """Two sessions stepping in turn on one server: their steps are not a lone session's (the scheduler would batch
    them), so none is answered in one call; their answers still check and advance."""
    hidden, blocks = _hidden(packed_llama), reference_model(packed_llama).config.num_hidden_layers
    with in_process_server(packed_llama, BlockRange(0, blocks), **NO_LANE) as server, \
            fa.KeyedStream(server.address, blocks=blocks) as first, \
            fa.KeyedStream(server.address, blocks=blocks) as second:
        for stream in (first, second):
            stream.request(_values(hidden, 0, t=2), step_id=1)
        for step_id in range(2, 6):
            for stream in (first, second):
                answer = stream.step(_values(hidden, step_id), step_id=step_id)
                assert isinstance(answer, compact.Answer) and answer.position == step_id + 1
        assert server.service.scheduler.inline_runs == 0
    assert one_call == []


@pytest.mark.parametrize("push", [False, True])
def test_greedy_tokens_through_two_servers_are_transformers_own(packed_llama, one_call, push):
    """Framed client, two servers of the packed file, relayed (STEPs) or pushed (the last server's PUSH_STEPs): the
    greedy tokens equal transformers' on the dequantized file, with the one-call answer taken on the way."""
    blocks = reference_model(packed_llama).config.num_hidden_layers
    prompt = [1, 17, 88, 3, 9, 250]
    with torch.no_grad():
        want = reference_model(packed_llama).generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                                      min_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):]
    with in_process_swarm(packed_llama, [BlockRange(0, blocks // 2), BlockRange(blocks // 2, blocks)], **NO_LANE) as swarm:
        client = client_of(swarm, frames=True, push=push)
        try:
            got = client.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        finally:
            client.close()
    assert got[0, len(prompt):].tolist() == want.tolist()
    # both servers, every decode step but the first: relayed, their STEPs; pushed, the first server's STEPs on the
    # route it keeps (its first decode step keeps it: a REQUEST) and the last server's PUSH_STEPs
    assert len(one_call) == (NEW_TOKENS - 2) * 2


@pytest.mark.parametrize("rows, kv_dtype", [(1, "float32"), (3, "float32"), (2, "float16")])
def test_the_stage_answers_what_its_step_computes_and_commits_alike(packed_llama, rows, kv_dtype):
    """Stage level: one session stepped by `step` and its twin by `answer_step` from the same values: the frame's
    values are `step`'s output bit for bit, its MAC and header are wire/compact.py's `answer_frame`'s for the same
    fields, and both caches (float32 or float16) and masks commit alike; a NaN changes nothing."""
    blocks = reference_model(packed_llama).config.num_hidden_layers
    stage = Stage(packed_llama, BlockRange(0, blocks), kv_dtype=kv_dtype)
    hidden = stage.hidden_size
    key, sid = b"k" * 32, "s" * 32
    states = [stage.new_state(stage.blocks, rows, 16) for _ in range(2)]
    prefill = torch.randn(rows, 3, hidden)
    for state in states:
        stage.step(state, prefill, no_padding_mask(rows, 3))
    decoder = stage.plain_decoder(states[1], rows)
    assert decoder is not None and stage.plain_decoder(states[1], rows + 1) is None
    for i in range(3):
        values = np.random.default_rng(10 + i).standard_normal((rows, 1, hidden), dtype=np.float32)
        want = stage.step(states[0], torch.from_numpy(values), no_padding_mask(rows, 1))
        body = compact.step_frame(key, sid, 5 + i, rows, 1, hidden, values.tobytes())[HEADER.size:]
        head = AnswerHead(5 + i, states[1].position + 1, 1, 0, 0.0, 0.0, 0.001, 0.0)
        frame = bytes(stage.answer_step(decoder, states[1], body, rows, FrameKey.of(key, sid), head))
        assert frame == compact.answer_frame(key, sid, 5 + i, states[1].position, want.numpy().tobytes(), 0.0,
                                             head.compute_s, head.parse_s, head.encode_s, 1)
        assert head.compute_s > 0 and head.parse_s >= 0.001
        assert torch.equal(states[0].mask, states[1].mask) and states[0].cache.length == states[1].cache.length
        n = states[0].cache.length
        assert torch.equal(states[0].cache.keys[..., :n, :], states[1].cache.keys[..., :n, :])
    bad = np.ones((rows, 1, hidden), dtype=np.float32)
    bad[rows - 1, 0, 0] = np.inf
    body = compact.step_frame(key, sid, 9, rows, 1, hidden, bad.tobytes())[HEADER.size:]
    position, length = states[1].position, states[1].cache.length
    assert stage.answer_step(decoder, states[1], body, rows, FrameKey.of(key, sid),
                             AnswerHead(9, position + 1, 1, 0, 0.0, 0.0, 0.0, 0.0)) is None
    assert states[1].position == position and states[1].cache.length == length
    assert stage.plain_decoder(stage.new_state(stage.blocks, rows, 16), rows) is None  # a first step: `step`'s
