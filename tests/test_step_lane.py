"""The step lane (server/lane.py, kernels/lane.c): a lone keyed session's plain decode steps on a packed span, taken
in one C call as their frame arrives, give transformers' tokens; whatever else happens to the session (another
session, a protobuf step, a hostile STEP, the end) goes the usual way from where the lane left it, answered exactly
as a server without the lane answers it."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from swarmlm.bench import frame_attacks as fa
from swarmlm.kernels import available
from swarmlm.model.random_checkpoint import init_checkpoint
from swarmlm.types import BlockRange
from swarmlm.wire import compact
from swarmlm.wire import swarm_pb2 as pb
from tests.gguf_fixtures import write_tiny_gguf
from tests.swarm_helpers import (client_of, greedy_session, in_process_server, in_process_swarm, reference_generate,
                                 reference_model)

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler: no packed kernels")


@pytest.fixture(scope="module", params=["packed llama", "tiny-bloom"])
def packed_llama(request, tmp_path_factory) -> str:
    """A tiny Llama GGUF in Q4_0 (the whole step in C), and tiny-bloom (transformers computes: C checks and answers)."""
    if request.param == "tiny-bloom":
        return request.getfixturevalue("tiny_bloom")
    root = tmp_path_factory.mktemp("lane")
    checkpoint = init_checkpoint("tiny-llama", root / "checkpoint", seed=7)
    return str(write_tiny_gguf(checkpoint, root / "tiny-q4_0.gguf", matrix_type="Q4_0"))


def _blocks(path: str) -> int:
    return int(reference_model(path).config.num_hidden_layers)


def _hidden(path: str) -> int:
    return int(reference_model(path).config.hidden_size)


def _greedy(client, prompt: list[int], new: int) -> list[int]:
    return greedy_session(client, torch.tensor([prompt]), new)[0]


def _want(path: str, prompt: list[int], new: int) -> list[int]:
    out = reference_generate(path, torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new)
    return out[0, len(prompt):].tolist()


def test_a_lone_sessions_decode_steps_take_the_lane_and_are_transformers_own(packed_llama):
    prompt, new = [1, 17, 88, 3, 9, 250], 12
    half = _blocks(packed_llama) // 2
    ranges = [BlockRange(0, half), BlockRange(half, 2 * half)]
    got = {}
    for lane in (True, False):
        with in_process_swarm(packed_llama, ranges, step_lane=lane) as swarm:
            client = client_of(swarm, frames=True, push=False)
            try:
                got[lane] = _greedy(client, prompt, new)
            finally:
                client.close()
            got[lane, "steps"] = [s.service.scheduler.lane_steps for s in swarm.servers]
    assert got[True] == got[False] == _want(packed_llama, prompt, new)
    # the first decode step goes the usual way and arms the lane; every later one takes it, on both servers
    assert got[True, "steps"] == [new - 2, new - 2]
    assert got[False, "steps"] == [0, 0]


def test_a_second_session_and_a_protobuf_step_go_on_from_where_the_lane_left(packed_llama):
    """Session A decodes on the lane; session B opens (A's lane is disarmed: A is no longer alone) and decodes the
    usual way; once B is closed, A goes on from where its lane left it, and arms one again. Every token is
    transformers'."""
    a, b, new = [1, 5, 6, 7], [1, 40, 41], 6
    with in_process_server(packed_llama, BlockRange(0, _blocks(packed_llama))) as server:
        swarm_client = client_of(_Single(server, packed_llama), frames=True, push=False)
        try:
            with torch.no_grad(), swarm_client.inference_session(max_length=32) as first:
                logits = swarm_client.step_logits(first, torch.tensor([a]))
                tokens_a = [int(logits[0, -1].argmax())]
                for _ in range(3):
                    logits = swarm_client.step_logits(first, torch.tensor([[tokens_a[-1]]]))
                    tokens_a.append(int(logits[0, -1].argmax()))
                lane = server.service.scheduler
                assert lane.lane_steps == 2  # (A's first decode step arms it)
                assert _greedy(swarm_client, b, new) == _want(packed_llama, b, new)
                assert lane.lane_steps == 2  # (B is never alone: A is open)
                for _ in range(new - 4):
                    logits = swarm_client.step_logits(first, torch.tensor([[tokens_a[-1]]]))
                    tokens_a.append(int(logits[0, -1].argmax()))
                assert lane.lane_steps == 2 + (new - 4) - 1  # (A alone again: armed after its next step)
            assert tokens_a == _want(packed_llama, a, new)
        finally:
            swarm_client.close()


class _Single:
    """One in-process server as a swarm a client reaches by address."""

    def __init__(self, server, model_dir: str) -> None:
        self.servers, self.model_dir, self.initial_peers = [server], model_dir, None

    @property
    def addresses(self) -> list[str]:
        return [self.servers[0].address]


def _values(hidden: int, step: int, fill: float | None = None) -> np.ndarray:
    values = np.random.default_rng(step).standard_normal((1, 1, hidden), dtype=np.float32)
    if fill is not None:
        values[0, 0, hidden // 3] = fill
    return values


def _follow_ups(hidden: int) -> dict[str, object]:
    """Name -> what a stream sends after three good steps (ids 1-3; the lane armed from the second on)."""
    def tampered(s):
        frame = bytearray(s.step_frame(_values(hidden, 4), 4))
        frame[-3] ^= 0x10
        return bytes(frame)

    return {
        "the next step": lambda s: s.step_frame(_values(hidden, 4), 4),
        "NaN": lambda s: s.step_frame(_values(hidden, 4, float("nan")), 4),
        "inf then a good step": lambda s: s.step_frame(_values(hidden, 4, float("inf")), 4) +
        s.step_frame(_values(hidden, 4), 4),
        "a changed byte": tampered,
        "a replayed step": lambda s: s.step_frame(_values(hidden, 3), 3) + s.step_frame(_values(hidden, 4), 4),
        "a step ahead, then its predecessor": lambda s: s.step_frame(_values(hidden, 5), 5) +
        s.step_frame(_values(hidden, 4), 4),
        "wrong dims": lambda s: s.step_frame(_values(hidden, 4), 4, dims=(1, 2, hidden)),
        "two rows": lambda s: s.step_frame(np.concatenate([_values(hidden, 4)] * 2), 4),
        "two steps in one write": lambda s: s.step_frame(_values(hidden, 4), 4) + s.step_frame(_values(hidden, 5), 5),
        "a protobuf step": lambda s: _request(s, _values(hidden, 4), 4),
        "past max_length": lambda s: b"".join(s.step_frame(_values(hidden, i), i) for i in range(4, 8)),
    }


def _request(stream, values: np.ndarray, step_id: int) -> bytes:
    from swarmlm.wire import codec, frames, session_keys
    from swarmlm.wire.frames import Kind

    request = session_keys.sign(stream.keys.client, stream.session_id, pb.InferenceRequest(step=pb.InferenceStep(
        hidden=codec.encode(torch.from_numpy(values)), step_id=step_id)))
    return frames.frame(Kind.REQUEST, request.SerializeToString())


def _answers(address: str, blocks: int, hidden: int, follow_up) -> tuple[list, list[str]]:
    """Three good steps, then `follow_up` and END: every answer's (kind, position, values) and the stream's end."""
    with fa.KeyedStream(address, blocks, max_length=6) as stream:
        stream.request(_values(hidden, 0).repeat(2, axis=1), step_id=0)  # (a prefill of 2 tokens: position 2)
        seen = []
        for step in (1, 2, 3):
            answer = stream.step(_values(hidden, step), step)
            seen.append(("ANSWER", answer.position, bytes(answer.data())))
        ends = stream.exchange(follow_up(stream) + fa.END)
    return seen, ends


def test_what_follows_the_lanes_steps_is_answered_as_without_the_lane(packed_llama):
    """Good steps, then each follow-up (hostile or not) on a session whose lane is armed: the same answers, frame for
    frame, as a server without the lane gives (refusals with their errors, a tampered step closing the session, a
    replay dropped, a step ahead held, the session's max_length, a protobuf step), and the server goes on."""
    blocks, hidden = _blocks(packed_llama), _hidden(packed_llama)
    results = {}
    for lane in (True, False):
        with in_process_server(packed_llama, BlockRange(0, blocks), step_lane=lane, session_idle_timeout_s=20.0,
                               open_idle_timeout_s=20.0) as server:
            for name, follow_up in _follow_ups(hidden).items():
                results[lane, name] = _answers(server.address, blocks, hidden, follow_up)
            results[lane, "steps"] = server.service.scheduler.lane_steps
            assert server.service.load.held == {}
    for name in _follow_ups(hidden):
        (seen_lane, ends_lane), (seen_plain, ends_plain) = results[True, name], results[False, name]
        assert [s[:2] for s in seen_lane] == [s[:2] for s in seen_plain] == [("ANSWER", 3), ("ANSWER", 4),
                                                                                ("ANSWER", 5)], name
        for (_, _, got), (_, _, want) in zip(seen_lane, seen_plain):
            assert np.allclose(np.frombuffer(got, np.float32), np.frombuffer(want, np.float32), atol=1e-5), name
        assert ends_lane == ends_plain, (name, ends_lane, ends_plain)
    assert results[True, "steps"] >= 2 * len(_follow_ups(hidden)) and results[False, "steps"] == 0


def test_mutated_steps_on_an_armed_lane_are_answered_as_without_it(packed_llama):
    """A differential fuzz: the session's next STEP with random bytes flipped (header, dims, values, MAC), cut short,
    grown, or followed by garbage, after the lane armed: every answer is the usual path's, and the server serves the
    next session."""
    import random

    blocks, hidden = _blocks(packed_llama), _hidden(packed_llama)
    rng = random.Random(40)

    def mutated(seed: int):
        def follow_up(s):
            r = random.Random(seed)
            frame = bytearray(s.step_frame(_values(hidden, 4), 4))
            how = r.randrange(4)
            if how == 0:
                for _ in range(r.randrange(1, 4)):
                    frame[r.randrange(len(frame))] ^= 1 << r.randrange(8)
            elif how == 1:
                frame = frame[:r.randrange(1, len(frame))]
            elif how == 2:
                frame += bytes(r.randrange(256) for _ in range(r.randrange(1, 40)))
            else:
                frame[r.randrange(5, 21)] = r.randrange(256)  # the STEP header: id, B, T, H
            return bytes(frame)
        return follow_up

    seeds = [rng.randrange(1 << 30) for _ in range(24)]
    results = {}
    for lane in (True, False):
        with in_process_server(packed_llama, BlockRange(0, blocks), step_lane=lane, session_idle_timeout_s=20.0,
                               open_idle_timeout_s=20.0) as server:
            for seed in seeds:
                results[lane, seed] = _answers(server.address, blocks, hidden, mutated(seed))[1]
            assert _answers(server.address, blocks, hidden, lambda s: b"")[1] == ["STATUS OK "]
            assert server.service.load.held == {}
    for seed in seeds:
        assert results[True, seed] == results[False, seed], seed


def _pieces(address: str, blocks: int, hidden: int, pause_s: float) -> tuple[list, list[str], int]:
    """Three good steps (the lane armed from the second on), then step 4 sent in two pieces `pause_s` apart, steps
    5 and 6 whole, END: every answer's (position, values) and the stream's end."""
    with fa.KeyedStream(address, blocks, max_length=8) as stream:
        stream.request(_values(hidden, 0).repeat(2, axis=1), step_id=0)
        seen = [stream.step(_values(hidden, step), step) for step in (1, 2, 3)]
        frame = stream.step_frame(_values(hidden, 4), 4)
        stream.send(frame[:len(frame) // 2])
        time.sleep(pause_s)
        stream.send(frame[len(frame) // 2:])
        seen.append(stream.answer())
        seen += [stream.step(_values(hidden, step), step) for step in (5, 6)]
        ends = stream.exchange(fa.END)
    return [(a.position, bytes(a.data())) for a in seen], ends


def test_a_step_in_pieces_is_answered_as_without_the_lane(packed_llama, monkeypatch):
    """A STEP whose bytes come in two reads: the lane's thread waits for the rest (a short pause), or, past its
    bound for a begun frame, hands what it read to the usual path, which waits for the rest itself. Either way the
    answers and the stream's end are a server's without the lane, and the lane takes the steps after it."""
    from swarmlm.server import lane as lane_module

    monkeypatch.setattr(lane_module, "_BEGUN_FRAME_S", 0.2)
    blocks, hidden = _blocks(packed_llama), _hidden(packed_llama)
    results = {}
    for lane in (True, False):
        with in_process_server(packed_llama, BlockRange(0, blocks), step_lane=lane, session_idle_timeout_s=20.0,
                               open_idle_timeout_s=20.0) as server:
            for pause_s in (0.02, 0.6):
                results[lane, pause_s] = _pieces(server.address, blocks, hidden, pause_s)
            results[lane, "steps"] = server.service.scheduler.lane_steps
    for pause_s in (0.02, 0.6):
        (seen_lane, ends_lane), (seen_plain, ends_plain) = results[True, pause_s], results[False, pause_s]
        assert [p for p, _ in seen_lane] == [p for p, _ in seen_plain] == [3, 4, 5, 6, 7, 8]
        for (_, got), (_, want) in zip(seen_lane, seen_plain):
            assert np.allclose(np.frombuffer(got, np.float32), np.frombuffer(want, np.float32), atol=1e-5)
        assert ends_lane == ends_plain == ["STATUS OK "]
    # steps 2, 3 and 6 of each stream at least (step 4 too when its pieces came within the bound)
    assert results[True, "steps"] >= 6 and results[False, "steps"] == 0


def test_a_forward_disarms_the_lane_and_the_session_goes_on(packed_llama):
    """Another client's Forward while a session's lane is armed: the scheduler disarms the lane before computing it
    (their kernels never run at once), the session's next steps go the usual way from where the lane left them and
    arm it again; every token is transformers'."""
    import grpc

    from swarmlm.wire import codec
    from swarmlm.wire import swarm_pb2_grpc as pb_grpc

    prompt, new = [1, 5, 6, 7], 8
    blocks, hidden = _blocks(packed_llama), _hidden(packed_llama)
    with in_process_server(packed_llama, BlockRange(0, blocks)) as server:
        client = client_of(_Single(server, packed_llama), frames=True, push=False)
        scheduler = server.service.scheduler
        try:
            with torch.no_grad(), client.inference_session(max_length=32) as session:
                logits = client.step_logits(session, torch.tensor([prompt]))
                tokens = [int(logits[0, -1].argmax())]
                for step in range(new - 1):
                    if step == 3:
                        assert scheduler.lane is not None and scheduler.lane_steps == 2
                        with grpc.insecure_channel(server.address) as channel:
                            reply = pb_grpc.SwarmStub(channel).Forward(pb.ForwardRequest(
                                start_block=0, end_block=blocks, hidden=codec.encode(torch.randn(1, 3, hidden))),
                                timeout=30)
                        assert list(reply.hidden.shape) == [1, 3, hidden]
                        assert scheduler.lane is None and scheduler.lane_steps == 2
                    before = time.monotonic()
                    logits = client.step_logits(session, torch.tensor([[tokens[-1]]]))
                    tokens.append(int(logits[0, -1].argmax()))
                    if step == 2:  # a lane step's end is the session's last use (its expiry reads it)
                        (held,) = server.service.sessions.sessions.values()
                        assert held.lane is scheduler.lane is not None and held.last_active_s() >= before
            assert tokens == _want(packed_llama, prompt, new)
            assert scheduler.lane_steps == new - 3  # (all but the first decode step and the one after the Forward)
        finally:
            client.close()


def test_the_attack_suites_hostile_steps_on_an_armed_lane(packed_llama):
    """The attack suite's hostile STEPs (swarmlm/bench/frame_attacks.py `compact_cases`), each sent by a lone session
    after a few decode steps (its lane armed): the clear answer each case expects, the same as a server without the
    lane gives, and the server serves the next session."""
    blocks, hidden = _blocks(packed_llama), _hidden(packed_llama)
    results = {}
    for lane in (True, False):
        with in_process_server(packed_llama, BlockRange(0, blocks), step_lane=lane, session_idle_timeout_s=20.0,
                               open_idle_timeout_s=20.0) as server:
            results[lane] = fa.run_compact_cases(server.address, hidden, blocks, warm=True)
            results[lane, "steps"] = server.service.scheduler.lane_steps
            assert _answers(server.address, blocks, hidden, lambda s: b"")[1] == ["STATUS OK "]
            assert server.service.load.held == {}
    bad = {name: got for name, got in results[True].items() if not fa.compact_expected(name, got)}
    assert not bad, bad
    assert results[True] == results[False]
    # (a case whose stream broke leaves its session detached for a while: the next ones are not alone, no lane)
    assert results[True, "steps"] > 0 and results[False, "steps"] == 0
