"""A pushed decode step on a kept route in the client's C chain (client/relay.py, kernels/chain.c `chain_pushed`):
hop 0's STEP written, one sleep until the last hop's answer, every hop's ANSWER taken in C. The tokens are
transformers' (and a client's without the chain); the chain and its lane really take the steps; against a hostile
or broken server at any hop (a tampered ANSWER, a refusal, a STATUS, a closed connection, another step's ANSWER,
silence) it stops at that hop and the step ends exactly as the Python path ends it."""
from __future__ import annotations

import socket
import threading

import grpc
import pytest
import torch

from swarmlm.client.frame_call import FrameCall
from swarmlm.client.pipeline import Hop, OpenSpan
from swarmlm.client.relay import RelayChain, RelayLane, chain_library
from swarmlm.client.streams import SpanStream
from swarmlm.errors import InvalidRequest, ServerFailed, ServerHung, ServerTampered
from swarmlm.types import BlockRange, Span
from swarmlm.wire import compact, frames, session_keys
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire.frames import Kind
from tests.swarm_helpers import client_of, greedy_reference, greedy_session, in_process_swarm
from tests.test_relay_chain import MAX_BODY, _Channels, _read_frame, route_step

pytestmark = pytest.mark.skipif(chain_library() is None, reason="no C compiler: the chain is not built")

THREE = [BlockRange(0, 2), BlockRange(2, 4), BlockRange(4, 6)]


@pytest.fixture
def chain_runs(monkeypatch) -> list:
    """Every RelayChain.run: whether pushed, and the hops it answered."""
    runs = []
    real = RelayChain.run

    def run(chain, x, bounds=None, pushed=False):
        result = real(chain, x, bounds, pushed)
        runs.append((pushed, result[0]))
        return result

    monkeypatch.setattr(RelayChain, "run", run)
    return runs


def _decode(client, ids: torch.Tensor, new: int):
    """`new` greedy tokens after `ids` in one session: the tokens, its step records and each span's history length."""
    tokens, session = greedy_session(client, ids, new)
    return tokens, list(session.steps), [len(s.history) for s in session.spans]


# ---- a live swarm ------------------------------------------------------------------------------------------------
def test_a_kept_routes_decode_steps_run_in_the_chain_with_transformers_tokens(tiny_bloom, monkeypatch, chain_runs):
    """3 servers, pushed: the first decode step keeps the route (Python: a REQUEST), every later one is the chain's
    pushed call (the first through the usual path, arming the lane, the rest in the lane), each server pushing on.
    The tokens, the records and the histories are those of a client without the chain."""
    new = 7
    ids, want = greedy_reference(tiny_bloom, "a pushed chain in C", new)
    # (the servers' usual path, whose pushers count the PUSH_STEPs: step lanes push on from their own connections)
    with in_process_swarm(tiny_bloom, THREE, step_lane=False) as swarm:
        pushers = [s.service.pusher for s in swarm.servers]
        client = client_of(swarm, frames=True, push=True)
        python = client_of(swarm, frames=True, push=True, relay_in_c=False)
        lane = []
        real_step = RelayLane.step
        monkeypatch.setattr(RelayLane, "step", lambda self, x: (lane.append(self.pushed), real_step(self, x))[1])
        try:
            tokens, records, history = _decode(client, ids, new)
            runs = list(chain_runs)
            python_tokens, python_records, python_history = _decode(python, ids, new)
        finally:
            client.close()
            python.close()
        assert [p.failed for p in pushers] == [0, 0, 0]
        # (two sessions' steps: each pushed on by the first two servers as a PUSH_STEP once its route is kept)
        assert [p.compact_frames for p in pushers] == [2 * (new - 2), 2 * (new - 1), 0]
    assert tokens == python_tokens == want
    assert runs == [(True, 3)] * (new - 2), "every decode step after the first: all 3 hops in the chain"
    assert lane == [True] * (new - 3), "after the first chained step, the lane's"
    assert history == python_history == [1 + new - 1] * 3
    assert len(records) == len(python_records)
    for record, python_record in zip(records[1:], python_records[1:]):
        assert record.pushed and record.blocking and python_record.pushed
        assert [h.pushed for h in record.hops] == [h.pushed for h in python_record.hops] == [True, True, False]
        assert all(h.wall_s > 0 and h.compute_s > 0 and h.n_tokens == 1 for h in record.hops)


def test_a_packed_models_kept_route_in_the_chain_takes_every_servers_lane(tmp_path, chain_runs):
    """A packed tiny Llama through 3 servers with step lanes, pushed: the client's chain and the servers' lanes take
    the decode steps, and the tokens are transformers'."""
    from swarmlm.kernels import available
    from swarmlm.model.random_checkpoint import init_checkpoint
    from tests.gguf_fixtures import write_tiny_gguf
    from tests.swarm_helpers import reference_generate, reference_model

    if not available():
        pytest.skip("no C compiler: no packed kernels")
    checkpoint = init_checkpoint("tiny-llama", tmp_path / "checkpoint", seed=7)
    path = str(write_tiny_gguf(checkpoint, tmp_path / "tiny-q4_0.gguf", matrix_type="Q4_0"))
    prompt, new = [1, 17, 88, 3, 9, 250], 12
    want = reference_generate(path, torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new)[0, len(prompt):]
    blocks = int(reference_model(path).config.num_hidden_layers)
    with in_process_swarm(path, [BlockRange(0, 2), BlockRange(2, 4), BlockRange(4, blocks)], step_lane=True) as swarm:
        client = client_of(swarm, frames=True, push=True)
        try:
            tokens, _, _ = _decode(client, torch.tensor([prompt]), new)
        finally:
            client.close()
        lane_steps = [s.service.scheduler.lane_steps for s in swarm.servers]
        failed = [s.service.pusher.failed for s in swarm.servers]
    assert tokens == want.tolist()
    assert chain_runs == [(True, 3)] * (new - 2)
    assert all(steps > 0 for steps in lane_steps) and failed == [0, 0, 0], (lane_steps, failed)


@pytest.mark.parametrize("in_c", [True, False])
def test_a_tampered_pushed_answer_bans_its_server_and_the_route_is_kept_anew(tiny_bloom, monkeypatch, chain_runs,
                                                                             in_c):
    """A live pushed route (a spare for the middle span): the middle server's third ANSWER (a chained step's, in C)
    changed on its way. The client bans it as tampered, fails over onto the spare (a new route, kept anew) and the
    tokens stay transformers'; the same with the chain as without it."""
    ids, want = greedy_reference(tiny_bloom, "a changed pushed answer", 7)
    changed = {"n": 0}
    real = compact.answer_frame

    def answer_frame(key, session_id, *args, **kwargs):
        frame = real(key, session_id, *args, **kwargs)
        if session_id == changed.get("sid"):
            changed["n"] += 1
            if changed["n"] == 3:
                frame = compact.AnswerFrame(frame[:60] + bytes([frame[60] ^ 1]) + frame[61:])
        return frame

    monkeypatch.setattr(compact, "answer_frame", answer_frame)
    with in_process_swarm(tiny_bloom, [BlockRange(0, 2), BlockRange(2, 4), BlockRange(2, 4), BlockRange(4, 6)],
                          step_lane=False) as swarm:
        client = client_of(swarm, frames=True, push=True, relay_in_c=in_c)
        try:
            with torch.no_grad(), client.inference_session(max_length=ids.shape[1] + 9) as session:
                logits = client.step_logits(session, ids)
                tokens = [int(logits[0, -1].argmax())]
                middle = session.spans[1].span.server_id
                changed["sid"] = session.spans[1].stream.session_id
                for _ in range(6):
                    logits = client.step_logits(session, torch.tensor([[tokens[-1]]]))
                    tokens.append(int(logits[0, -1].argmax()))
                assert changed["n"] >= 3 and session.spans[1].span.server_id != middle
                ban = client.remote.view.bans[middle]
                assert ban.tampered and ban.failures == 1
                assert all(record.pushed for record in session.steps[1:])
        finally:
            client.close()
    assert tokens == want
    if in_c:  # decode steps 2 and 3 in the chain, 3 stopped at the middle hop; after the failover, kept anew
        assert chain_runs[:2] == [(True, 3), (True, 1)] and chain_runs[2:] == [(True, 3)] * (len(chain_runs) - 2)
    else:
        assert chain_runs == []


# ---- servers by hand, on socket pairs ----------------------------------------------------------------------------
CLIENT_KEY, SERVER_KEY = b"c" * 32, b"s" * 32
KEYS = session_keys.SessionKeys(client=CLIENT_KEY, server=SERVER_KEY, push=b"p" * 32, seal=b"e" * 32)
ROWS, HIDDEN = 2, 16
BOUND_S = 0.3  # each reply's hang timeout here


def _sid(i: int) -> str:
    return f"session-{i}"


def _answer(i: int, step_id: int, values: bytes, n: int, key: bytes = SERVER_KEY) -> bytes:
    pushed = (ROWS, 1, HIDDEN) if i + 1 < n else None  # (flag PUSHED: every hop's but the last's)
    return compact.answer_frame(key, _sid(i), step_id, 7, values, 0.001, 0.002, 0.0001, 0.0001, 1, pushed)


def _refusal(i: int, step_id: int) -> bytes:
    reply = pb.InferenceReply(step_id=step_id, error=pb.Error(code="INVALID_REQUEST", message="no thanks"))
    return frames.frame(Kind.REPLY, session_keys.sign(SERVER_KEY, _sid(i), reply).SerializeToString())


# what hop i's server sends the client for its step (its input's values `got`, the route's n hops): bytes, or
# (bytes, None): it closes the connection after them; "silent": nothing. Every server pushes its output on.
BEHAVIOURS = {
    "honest": lambda i, got, n: _answer(i, 1, _plus_one(got), n),
    "tampered": lambda i, got, n: _answer(i, 1, _plus_one(got), n, key=b"x" * 32),
    "refusal": lambda i, got, n: _refusal(i, 1),
    "status": lambda i, got, n: frames.status(grpc.StatusCode.RESOURCE_EXHAUSTED, "full"),
    "closes mid-frame": lambda i, got, n: (_answer(i, 1, _plus_one(got), n)[:40], None),
    "another step's": lambda i, got, n: _answer(i, 2, _plus_one(got), n),
    "short": lambda i, got, n: _answer(i, 1, _plus_one(got)[:-4], n),
    "silent": lambda i, got, n: "silent",
}


def _plus_one(values: bytes) -> bytes:
    """What an honest server answers: its input plus one (so each hop's output differs)."""
    return (torch.frombuffer(bytearray(values), dtype=torch.float32) + 1).numpy().tobytes()


def _serve(i: int, sock: socket.socket, behaviour, pushes: list[threading.Event], inputs: list, n: int) -> None:
    """Hop i's server: hop 0 reads the client's STEP, a later hop awaits the previous server's push; each answers
    its stream as `behaviour` says and pushes its output on."""
    if i == 0:
        got = _read_frame(sock)
        if got is None:
            return
        kind, body = got
        step = compact.CompactStep(body)
        assert kind == Kind.STEP and step.verified(CLIENT_KEY, _sid(0)) and step.step_id == 1
        values = step.values().tobytes()
    elif not pushes[i - 1].wait(5.0):
        return
    else:
        values = inputs[i - 1]
    inputs[i] = _plus_one(values)
    out = behaviour(i, values, n)
    try:
        if isinstance(out, tuple):
            sock.sendall(out[0])
            sock.shutdown(socket.SHUT_RDWR)
        elif out != "silent":
            sock.sendall(out)
    except OSError:  # (the test closed it: the step ended before this hop was read)
        pass
    pushes[i].set()  # (after its answer, as a server pushes on)


def _route(behaviours: list) -> tuple[list[Hop], list[socket.socket]]:
    """A pushed route whose first server keeps it (its last step named each later session at step id 0)."""
    n = len(behaviours)
    hops, ends = [], []
    pushes, inputs = [threading.Event() for _ in behaviours], [None] * n
    for i, behaviour in enumerate(behaviours):
        mine, theirs = socket.socketpair()
        mine.setblocking(False)
        stream = SpanStream(_Channels(), Span(f"server-{i}", i, i + 1, f"127.0.0.1:{9000 + i}"), 1.0)
        stream.call = FrameCall(mine, MAX_BODY)
        stream.keys, stream.session_id, stream.session_secret = KEYS, _sid(i), bytes(16)
        if behaviour == "gone":  # (closed before the step: hop 0's write fails)
            theirs.close()
        else:
            threading.Thread(target=_serve, args=(i, theirs, behaviour, pushes, inputs, n), daemon=True).start()
        hops.append(Hop(OpenSpan(stream.span, stream)))
        ends.append(theirs)
    hops[0].stream._route = tuple((_sid(i), 0) for i in range(1, n))
    return hops, ends


def _step(behaviours: list, in_c: bool) -> dict:
    """One pushed decode step over a route whose servers behave so: what it ended with, and each hop's state."""
    hops, ends = _route(behaviours)
    ended, pipeline, chain, state = route_step(hops, ends, in_c, True)
    return {"ended": ended, "hops": state, "route": hops[0].stream._route,
            "timings": [t.pushed for t in pipeline.timings],
            "answered_in_c": chain.answered if chain is not None else None}


def test_an_honest_pushed_route_answers_every_hop_in_the_chain_as_in_python():
    in_c, python = _step([BEHAVIOURS["honest"]] * 3, True), _step([BEHAVIOURS["honest"]] * 3, False)
    assert in_c.pop("answered_in_c") == 3 and python.pop("answered_in_c") is None
    assert in_c == python and in_c["ended"] == ("failed", {}, [])
    assert in_c["route"] == ((_sid(1), 1), (_sid(2), 1)), "the kept route one step on"
    assert in_c["timings"] == [True, True, False]
    x = torch.arange(ROWS * HIDDEN, dtype=torch.float32)
    assert in_c["hops"][2][2] == [bytes((x + 3).numpy())], "each hop's output the next one's input"


@pytest.mark.parametrize("name", [n for n in BEHAVIOURS if n != "honest"])
@pytest.mark.parametrize("at", [0, 1, 2])
def test_a_hostile_or_broken_hop_stops_the_pushed_chain_and_python_ends_the_step_the_same(name, at):
    behaviours = [BEHAVIOURS["honest"]] * 3
    behaviours[at] = BEHAVIOURS[name]
    in_c, python = _step(behaviours, in_c=True), _step(behaviours, in_c=False)
    assert in_c.pop("answered_in_c") == at, "the chain took the hops before it, then stopped there"
    python.pop("answered_in_c")
    assert in_c == python
    ended = in_c["ended"]
    expected = {"tampered": ServerTampered, "silent": ServerHung}.get(name, ServerFailed)
    if name == "refusal":
        assert ended == ("raised", InvalidRequest, "server-%d: no thanks" % at)
    else:
        assert ended[0] == "failed" and list(ended[1]) == [at] and issubclass(ended[1][at][0], expected)
        assert ended[2] == list(range(at + 1, 3)), "the hops after it awaited their pushed step: reopened"
    assert [h[1] for h in in_c["hops"]] == [1] * at + [0] * (3 - at), "the hops before it answered, none after"


def test_a_first_server_gone_before_the_step_fails_it_as_in_python():
    """Hop 0's connection closed before the step: the chain's write fails, nothing is read, and the step ends as
    Python's (its server failed, the hops after it awaiting their pushed step reopened)."""
    behaviours = ["gone", BEHAVIOURS["honest"], BEHAVIOURS["honest"]]
    in_c, python = _step(behaviours, in_c=True), _step(behaviours, in_c=False)
    assert in_c.pop("answered_in_c") == 0
    python.pop("answered_in_c")
    assert in_c == python
    assert in_c["ended"][0] == "failed" and list(in_c["ended"][1]) == [0] and in_c["ended"][2] == [1, 2]
