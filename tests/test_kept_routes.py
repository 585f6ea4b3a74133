"""Kept routes (protocol 4, docs/PROTOCOL.md "Kept routes"): a pushed route's first plain decode step has its servers
keep the route (InferenceStep.keep_route), and the next ones go as one STEP frame to the first server, each pushed on
as a PUSH_STEP, with the same tokens as transformers; a step without keep_route drops the route; keep_route where it
cannot hold is refused and changes nothing."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from swarmlm.bench import frame_attacks as fa
from swarmlm.types import BlockRange
from swarmlm.wire import codec, compact, frames, session_keys
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire.frames import Kind
from tests.swarm_helpers import client_of, greedy_reference, greedy_session, in_process_swarm

HIDDEN = 64  # tiny-bloom's
RANGES = [BlockRange(0, 2), BlockRange(2, 4), BlockRange(4, 6)]


def _decode(client, ids: torch.Tensor, new: int, before_step=None) -> tuple[list[int], list]:
    """`new` greedy tokens after `ids`: the tokens and the session's step records."""
    tokens, session = greedy_session(client, ids, new, before_step)
    return tokens, list(session.steps)


def test_a_kept_route_writes_one_step_frame_a_token_and_gives_the_same_tokens(tiny_bloom, monkeypatch):
    """3 servers, pushed, framed: the first decode step keeps the route (a REQUEST naming it, its pushes PushRequests
    handing the rest on), every later one is one STEP to the first server, pushed on as a PUSH_STEP by the first and
    the middle server; the greedy tokens equal transformers'. (The usual path's frames, counted by the pushers: no
    step lanes here; lanes on kept routes are the next tests'.)"""
    new = 6
    ids, want = greedy_reference(tiny_bloom, "kept routes through three servers", new)
    steps_written = []
    real = compact.step_frame
    monkeypatch.setattr(compact, "step_frame", lambda *a: (steps_written.append(a[1]), real(*a))[1])
    with in_process_swarm(tiny_bloom, RANGES, step_lane=False) as swarm:
        pushers = [s.service.pusher for s in swarm.servers]
        # (the Python path's STEPs: the C chain builds its own, tests/test_pushed_chain.py)
        client = client_of(swarm, frames=True, push=True, relay_in_c=False)
        try:
            got, records = _decode(client, ids, new)
        finally:
            client.close()
        assert got == want
        assert [p.compact_frames for p in pushers] == [new - 2, new - 1, 0]
        assert [p.failed for p in pushers] == [0, 0, 0]
        assert len(steps_written) == new - 2 and len(set(steps_written)) == 1  # all to one session: the first hop's
    for record in records[1:]:  # (every decode step: pushed on by the first two servers)
        assert [h.pushed for h in record.hops] == [True, True, False]


def test_a_step_without_keep_route_drops_the_route_and_relaying_goes_on(tiny_bloom, monkeypatch):
    """Pushed with a kept route for a few tokens, then relayed (the client's push rule turns): the first relayed step
    is a REQUEST, which drops the first server's route (a STEP there would be pushed on), and the tokens stay
    transformers'."""
    new = 7
    ids, want = greedy_reference(tiny_bloom, "a route kept, then dropped", new)
    with in_process_swarm(tiny_bloom, RANGES) as swarm:
        client = client_of(swarm, frames=True, push=True)
        routes = []

        def turn(i: int) -> None:
            sessions = list(swarm.servers[0].service.sessions.sessions.values())
            routes.append(sessions[0].stream_route is not None)
            if i == 3:
                monkeypatch.setattr(client.remote, "push", lambda spans: False)
                client.remote.router.syncs += 1  # (as a sync that turns push does: a relay lane is decided anew)

        try:
            got, records = _decode(client, ids, new, turn)
        finally:
            client.close()
        assert got == want
    assert routes == [False, True, True, True, False, False]  # (seen before each decode step: kept at the first)
    assert [h.pushed for h in records[-1].hops] == [False, False, False]


def _route_target(pusher: fa.KeyedStream, target: fa.KeyedStream, address: str, sealed: bool = True):
    """The push target naming `target`'s session, its push key sealed for `pusher`'s server (or none)."""
    return pb.PushTarget(address=address, session_id=target.session_id, step_id=target.next_id, secret=target.secret,
                         push_key=session_keys.seal_push_key(pusher.keys.seal, target.session_id, target.keys.push)
                         if sealed else b"")


def _request(stream: fa.KeyedStream, values: np.ndarray, step_id: int, push=(), keep_route: bool = False):
    request = session_keys.sign(stream.keys.client, stream.session_id, pb.InferenceRequest(step=pb.InferenceStep(
        hidden=codec.encode(torch.from_numpy(values)), step_id=step_id, push=push, keep_route=keep_route)))
    stream.send(frames.frame(Kind.REQUEST, request.SerializeToString()))
    return stream.answer()


def test_keep_route_where_it_cannot_hold_is_refused_and_changes_nothing(tiny_bloom):
    """keep_route on a prompt step, keep_route without targets and no route kept, keep_route to a target without a
    push key: each refused by a REPLY naming why, before any compute (the session's position unchanged), and the
    session goes on: an honest decode step after them is answered. (Steps without ids: a refused step's id is
    taken all the same, by the session's step order.)"""
    rng = np.random.default_rng(5)
    with in_process_swarm(tiny_bloom, RANGES[:2]) as swarm:
        first, second = swarm.addresses
        with fa.KeyedStream(first, 2, max_length=32) as s1, fa.KeyedStream(second, 4, max_length=32, start=2) as s2:
            prompt = rng.standard_normal((1, 2, HIDDEN), dtype=np.float32)
            reply = _request(s1, prompt, 0, [_route_target(s1, s2, second)], keep_route=True)
            assert "keep_route: only on a plain decode step" in reply.error.message
            reply = _request(s1, prompt, 0)  # (the prompt, honest: nothing was taken)
            assert not reply.HasField("error") and reply.position == 2
            token = rng.standard_normal((1, 1, HIDDEN), dtype=np.float32)
            reply = _request(s1, token, 0, keep_route=True)
            assert "no route is kept for this session's steps from its stream" in reply.error.message
            reply = _request(s1, token, 0, [_route_target(s1, s2, second, sealed=False)], keep_route=True)
            assert "the next server's session is not keyed" in reply.error.message
            session = swarm.servers[0].service.sessions.sessions[s1.session_id]
            assert session.stream_route is None and session.state.position == 2
            answer = s1.step(token, 0)  # (a STEP: answered alone, no route kept)
            assert type(answer) is compact.Answer and answer.position == 3 and not answer.pushed


def test_a_kept_route_is_the_sources_own(tiny_bloom):
    """A route kept by the session's stream pushes its STEPs on, not its pushed steps; a route kept by a push pushes
    PUSH_STEPs on, not its stream's STEPs (a client relaying to a middle server after pushing gets its answer alone)."""
    rng = np.random.default_rng(6)
    with in_process_swarm(tiny_bloom, RANGES) as swarm:
        first, second, third = swarm.addresses
        with fa.KeyedStream(first, 2, max_length=32) as s1, fa.KeyedStream(second, 4, max_length=32, start=2) as s2, \
                fa.KeyedStream(third, 6, max_length=32, start=4) as s3:
            for stream in (s1, s2, s3):  # (the same prompt everywhere: each server's session holds 2 positions)
                assert _request(stream, rng.standard_normal((1, 2, HIDDEN), dtype=np.float32), 0).position == 2
            token = rng.standard_normal((1, 1, HIDDEN), dtype=np.float32)
            targets = [_route_target(s1, s2, second), _route_target(s2, s3, third)]
            answer = _request(s1, token, 1, targets, keep_route=True)
            assert type(answer) is compact.Answer and answer.pushed
            for stream in (s2, s3):  # (pushed: each answers its own stream)
                assert stream.answer().position == 3
            services = [s.service for s in swarm.servers]
            kept = [services[0].sessions.sessions[s1.session_id].stream_route,
                    services[1].sessions.sessions[s2.session_id].push_route]
            assert [r.target.session_id for r in kept] == [s2.session_id, s3.session_id]
            assert services[1].sessions.sessions[s2.session_id].stream_route is None
            # the middle server's own stream: its STEP is answered alone (its route is its pushes')
            answer = s2.step(rng.standard_normal((1, 1, HIDDEN), dtype=np.float32), 2)
            assert type(answer) is compact.Answer and not answer.pushed and answer.position == 4


@pytest.mark.parametrize("model", ["packed llama", "tiny-bloom"])
def test_a_kept_routes_steps_take_every_servers_step_lane_and_are_transformers_own(model, tmp_path, request):
    """A model through 3 servers, pushed: once the route is kept, the first server's lane takes the client's STEPs
    and pushes each output on, the middle one's takes those PUSH_STEPs from its push connection and pushes on, the
    last one's takes its PUSH_STEPs; every answer goes to the client's stream. A packed model's lanes are each one C
    call a step; tiny-bloom's run transformers' forward between C's read and C's answer and push. The tokens are
    transformers'; without lanes (the usual path) the same."""
    from tests.swarm_helpers import reference_generate, reference_model

    path = _tiny_packed(tmp_path) if model == "packed llama" else request.getfixturevalue("tiny_bloom")
    prompt, new = [1, 17, 88, 3, 9, 250], 12
    want = reference_generate(path, torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new)[0, len(prompt):]
    blocks = int(reference_model(path).config.num_hidden_layers)
    ranges = [BlockRange(0, 2), BlockRange(2, 4), BlockRange(4, blocks)]
    got = {}
    for lane in (True, False):
        with in_process_swarm(path, ranges, step_lane=lane) as swarm:
            client = client_of(swarm, frames=True, push=True)
            try:
                got[lane], _ = _decode(client, torch.tensor([prompt]), new)
            finally:
                client.close()
            got[lane, "lane steps"] = [s.service.scheduler.lane_steps for s in swarm.servers]
            got[lane, "failed pushes"] = [s.service.pusher.failed for s in swarm.servers]
    assert got[True] == got[False] == want.tolist()
    assert all(steps > 0 for steps in got[True, "lane steps"]), got
    assert got[False, "lane steps"] == [0, 0, 0] and got[True, "failed pushes"] == [0, 0, 0]


def _tiny_packed(tmp_path) -> str:
    from tests.gguf_fixtures import write_tiny_gguf
    from swarmlm.model.random_checkpoint import init_checkpoint

    checkpoint = init_checkpoint("tiny-llama", tmp_path / "checkpoint", seed=7)
    return str(write_tiny_gguf(checkpoint, tmp_path / "tiny-q4_0.gguf", matrix_type="Q4_0"))


def _pushed_session(address: str, blocks: int, hidden: int, hostile) -> tuple[list, list[str], list[str]]:
    """A keyed session fed by a push connection: a prompt on its stream, two honest PUSH_STEPs (each answered on
    the stream: a lane that reads pushes arms after them), then `hostile(stream)`'s frames and a third honest one on
    the same push connection. Returns the stream's answers (kind, position, values), the push connection's answers,
    and the stream's end."""
    rng = np.random.default_rng(9)
    host, port = address.rsplit(":", 1)[0], fa.frame_port(address)
    with fa.KeyedStream(address, blocks, max_length=16) as stream, fa.KeyedStream.plain(host, port) as pusher:
        stream.request(rng.standard_normal((1, 2, hidden), dtype=np.float32), step_id=0)

        def push(step_id: int) -> bytes:
            values = rng.standard_normal((1, 1, hidden), dtype=np.float32)
            return compact.push_frame(stream.keys.push, stream.session_id, stream.secret, step_id, 1, 1, hidden,
                                      values.tobytes())

        seen = []
        pusher.send(fa.PUSH_HELLO)
        for step_id in (1, 2):
            pusher.send(push(step_id))
            answer = stream.answer()
            seen.append(("ANSWER", answer.position, bytes(answer.data())))
        pusher.send(hostile(stream, push) + push(3))
        answer = stream.answer()
        seen.append((type(answer).__name__, answer.position))
        pushes = pusher.exchange(b"")
        if pushes and pushes[-1] == "closed":  # (a push connection ends without a word of its own)
            pushes = pushes[:-1]
        ends = stream.exchange(fa.END)
    return seen, pushes, ends


def test_hostile_pushes_on_a_lane_that_reads_pushes_are_answered_as_without_it(tmp_path):
    """A lone session fed by pushes (its lane reads the push connection once armed): PUSH_STEPs with the wrong
    secret, a changed MAC, into another session, of a step id already taken, then an honest one: the same answers
    (REFUSED naming the step, a replay dropped), frame for frame, as a server without lanes gives, and the session
    goes on."""
    from swarmlm.wire.session_keys import MAC_BYTES

    path = _tiny_packed(tmp_path)
    from tests.swarm_helpers import in_process_server, reference_model
    config = reference_model(path).config
    blocks, hidden = int(config.num_hidden_layers), int(config.hidden_size)

    def hostile(stream, push) -> bytes:
        wrong_secret = compact.push_frame(stream.keys.push, stream.session_id, b"w" * 16, 3, 1, 1, hidden,
                                          b"\0" * 4 * hidden)
        changed = bytearray(push(3))
        changed[-MAC_BYTES - 1] ^= 1
        other = compact.push_frame(stream.keys.push, "f" * 32, stream.secret, 3, 1, 1, hidden, b"\0" * 4 * hidden)
        return wrong_secret + bytes(changed) + other + push(2)  # (2: taken already, a duplicate: dropped)

    results = {}
    for lane in (True, False):
        with in_process_server(path, BlockRange(0, blocks), step_lane=lane, session_idle_timeout_s=20.0,
                               open_idle_timeout_s=20.0) as server:
            results[lane] = _pushed_session(server.address, blocks, hidden, hostile)
            results[lane, "steps"] = server.service.scheduler.lane_steps
    seen, pushes, ends = results[True]
    assert results[True][1:] == results[False][1:] and [s[:2] for s in seen] == [s[:2] for s in results[False][0]]
    assert seen[:2] == results[False][0][:2]
    assert [s[:2] for s in seen] == [("ANSWER", 3), ("ANSWER", 4), ("Answer", 5)]
    assert len(pushes) == 3 and pushes[0] == "REFUSED 3 PERMISSION_DENIED a push must carry the session's secret"
    assert pushes[1].startswith("REFUSED 3 PERMISSION_DENIED a PUSH_STEP must carry")
    assert pushes[2].startswith("REFUSED 3 NOT_FOUND no stream holds session")
    assert ends == ["STATUS OK "]
    assert results[True, "steps"] > 0 and results[False, "steps"] == 0


def test_a_session_fed_by_protobuf_pushes_arms_no_lane_on_its_stream(tmp_path):
    """Pushed, each step naming its route (keep_routes off): the middle server's steps come as PUSHes (protobuf: the
    rest of the route), so no lane is armed on its stream after each answer (the next push would disarm it at once,
    a thread started and joined per step: what the route's last server did before lanes read push connections); the
    last server's PUSH_STEPs take a lane on their push connection. The tokens are transformers'."""
    import time

    from tests.swarm_helpers import reference_generate, reference_model

    path = _tiny_packed(tmp_path)
    blocks = int(reference_model(path).config.num_hidden_layers)
    prompt, new = [1, 17, 88, 3, 9, 250], 8
    want = reference_generate(path, torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new)[0, len(prompt):]
    with in_process_swarm(path, [BlockRange(0, 2), BlockRange(2, 4), BlockRange(4, blocks)]) as swarm:
        client = client_of(swarm, frames=True, push=True, keep_routes=False)
        middle, last = (s.service for s in swarm.servers[1:])
        try:
            got, records = _decode(client, torch.tensor([prompt]), new)
            time.sleep(0.2)  # (an answer's lane is armed right after it is written)
            assert not middle.streams.lanes and middle.scheduler.lane is None
        finally:
            client.close()
    assert got == want.tolist() and records[-1].pushed
    assert middle.scheduler.lane_steps == 0 and last.scheduler.lane_steps > 0
