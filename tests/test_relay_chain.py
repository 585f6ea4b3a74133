"""The client's relayed decode step in C (client/relay.py, kernels/chain.c): taken for a plain relayed decode step,
the tokens transformers' own; and against hostile or broken servers (a tampered ANSWER, a refusal, a STATUS, a
connection closed mid-frame, garbage, an oversized or short frame, another step's ANSWER, silence) the C chain stops
at that hop and the step ends exactly as the Python path ends it: the same failure (or refusal) of the same hop,
the hops before it answered, their outputs and the stream's state the same."""
from __future__ import annotations

import socket
import threading
from types import SimpleNamespace

import grpc
import pytest
import torch

from swarmlm.client.chunking import BandwidthEstimate
from swarmlm.client.frame_call import FrameCall
from swarmlm.client.pipeline import Hop, OpenSpan, StepPipeline
from swarmlm.client.relay import RelayChain, RelayLane, chain_library
from swarmlm.client.streams import SpanStream
from swarmlm.config import ClientConfig
from swarmlm.errors import InvalidRequest, ServerFailed, ServerHung, ServerTampered
from swarmlm.types import BlockRange, Span
from swarmlm.wire import compact, frames, session_keys
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire.frames import HEADER, Kind
from swarmlm.wire.links import LinkScheduler, TransmissionPolicy
from tests.swarm_helpers import client_of, greedy_reference, greedy_session, in_process_swarm

pytestmark = pytest.mark.skipif(chain_library() is None, reason="no C compiler: the chain is not built")

HIDDEN, ROWS = 16, 2
CLIENT_KEY, SERVER_KEY, SID = b"c" * 32, b"s" * 32, "session-1"
BOUND_S = 0.3  # each reply's hang timeout here (a silent server is noticed after it)
MAX_BODY = 64 << 20  # (a frame call's limit: ClientConfig.max_message_bytes' default)


# ---- a live swarm ------------------------------------------------------------------------------------------------
def test_a_relayed_decode_step_runs_in_the_c_chain_and_keeps_transformers_tokens(tiny_bloom):
    ids, want = greedy_reference(tiny_bloom, "the chain in C", 6)
    with in_process_swarm(tiny_bloom, [BlockRange(0, 2), BlockRange(2, 4), BlockRange(4, 6)]) as swarm:
        client = client_of(swarm, frames=True, push=False)
        python = client_of(swarm, frames=True, push=False, relay_in_c=False)
        try:
            tokens, session = greedy_session(client, ids, 6)
            python_tokens, python_session = greedy_session(python, ids, 6)
            chain, steps, no_chain, python_steps = session._relay, session.steps, python_session._relay, \
                python_session.steps
        finally:
            client.close()
            python.close()
    assert tokens == python_tokens == want
    assert chain is not None and chain.answered == 5 * 3, "every decode step's 3 hops in the chain"
    assert no_chain is None
    for step in steps[1:]:  # each hop's timing recorded as the Python path records it
        assert step.blocking and len(step.hops) == 3
        assert all(h.wall_s > 0 and h.compute_s > 0 and h.client_io_s > 0 and h.n_tokens == 1 for h in step.hops)
    assert [len(s.hops) for s in steps] == [len(s.hops) for s in python_steps]


# ---- servers by hand, on socket pairs ----------------------------------------------------------------------------
class _Channels:
    """What a stream asks of Channels: a link scheduler, the wire format, a bandwidth estimate."""

    def __init__(self) -> None:
        self._link = LinkScheduler(TransmissionPolicy())
        self._bandwidth = BandwidthEstimate(1e9)

    def link(self, address: str) -> LinkScheduler:
        return self._link

    def wire_dtype_for(self, address: str, float32_bytes: int | None = None) -> str:
        return "float32"

    def bandwidth(self, address: str) -> BandwidthEstimate:
        return self._bandwidth


def _read_frame(sock: socket.socket) -> tuple[int, bytes] | None:
    data = b""
    while len(data) < HEADER.size or len(data) < HEADER.size + HEADER.unpack_from(data)[0]:
        try:
            more = sock.recv(1 << 16)
        except OSError:  # (the test closed it: its hop was never reached)
            return None
        if not more:
            return None
        data += more
    size, kind = HEADER.unpack_from(data)
    return kind, data[HEADER.size:HEADER.size + size]


def _answer(step: compact.CompactStep, values: bytes, key: bytes = SERVER_KEY, step_id: int | None = None) -> bytes:
    return compact.answer_frame(key, SID, step.step_id if step_id is None else step_id, 7, values, 0.001, 0.002,
                                0.0001, 0.0001, 1)


def _refusal(step: compact.CompactStep) -> bytes:
    reply = pb.InferenceReply(step_id=step.step_id, error=pb.Error(code="INVALID_REQUEST", message="no thanks"))
    return frames.frame(Kind.REPLY, session_keys.sign(SERVER_KEY, SID, reply).SerializeToString())


def _output(step: compact.CompactStep) -> bytes:
    """What an honest server answers: its input plus one (so each hop's output differs)."""
    return (torch.frombuffer(bytearray(step.values().tobytes()), dtype=torch.float32) + 1).numpy().tobytes()


# what the server of the hop under test does with its STEP: returns the bytes it sends (None: it closes the
# connection after them; "silent": nothing, the connection kept open)
BEHAVIOURS = {
    "honest": lambda step: _answer(step, _output(step)),
    "tampered": lambda step: _answer(step, _output(step), key=b"x" * 32),
    "a byte changed": lambda step: (lambda f: f[:-20] + bytes([f[-20] ^ 1]) + f[-19:])(_answer(step, _output(step))),
    "refusal": _refusal,
    "status": lambda step: frames.status(grpc.StatusCode.RESOURCE_EXHAUSTED, "full"),
    "closes mid-frame": lambda step: (_answer(step, _output(step))[:40], None),
    "closes": lambda step: (b"", None),
    "garbage": lambda step: bytes([0, 0, 0, 9, 200]) + b"\xff" * 9,
    "oversized": lambda step: HEADER.pack(MAX_BODY + 1, Kind.ANSWER) + b"\0" * 64,
    "short": lambda step: _answer(step, _output(step)[:-4]),
    "another step's": lambda step: _answer(step, _output(step), step_id=step.step_id + 1),
    "silent": lambda step: "silent",
    # before the STEP comes: the connection closed (the write fails), after a STATUS (the write's failure names it)
    "gone": b"",
    "refused, then gone": frames.status(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many sessions"),
}


def _serve(sock: socket.socket, behaviour, steps: int) -> None:
    """A server of one hop: each STEP checked and answered as `behaviour` says."""
    for _ in range(steps):
        got = _read_frame(sock)
        if got is None:
            return
        kind, body = got
        step = compact.CompactStep(body)
        assert kind == Kind.STEP and step.verified(CLIENT_KEY, SID)
        out = behaviour(step)
        if out == "silent":
            return
        if isinstance(out, tuple):
            sock.sendall(out[0])
            sock.shutdown(socket.SHUT_RDWR)
            return
        sock.sendall(out)


def _route(behaviours: list) -> tuple[list[Hop], list[socket.socket]]:
    hops, ends = [], []
    for i, behaviour in enumerate(behaviours):
        mine, theirs = socket.socketpair()
        mine.setblocking(False)
        stream = SpanStream(_Channels(), Span(f"server-{i}", i, i + 1, f"127.0.0.1:{9000 + i}"), 1.0)
        stream.call = FrameCall(mine, MAX_BODY)
        stream.keys = SimpleNamespace(client=CLIENT_KEY, server=SERVER_KEY)
        stream.session_id = SID
        if behaviour == "deaf":  # (reads nothing: a large STEP's write finds no room)
            pass
        elif isinstance(behaviour, bytes):  # (gone before the step)
            theirs.sendall(behaviour)
            theirs.close()
        else:
            threading.Thread(target=_serve, args=(theirs, behaviour, 1), daemon=True).start()
        hops.append(Hop(OpenSpan(stream.span, stream)))
        ends.append(theirs)
    return hops, ends


def route_step(hops: list, ends: list, in_c: bool, push: bool, hidden: int = HIDDEN) -> tuple:
    """One decode step of x = 0, 1, 2 ... [ROWS, 1, hidden] through `hops` (fake servers at `ends`, closed after
    it), in the C chain or in Python, relayed or pushed: how it ended, the pipeline, the chain (None: Python), and
    each hop's state (written, outputs' count, outputs' bytes, span position, step id, unanswered, stream
    position, bytes read ahead, history length)."""
    chain = RelayChain(chain_library(), [h.stream for h in hops]) if in_c else None
    x = torch.arange(ROWS * hidden, dtype=torch.float32).reshape(ROWS, 1, hidden)
    mask = torch.ones(ROWS, 1, dtype=torch.long)
    pipeline = StepPipeline(hops, [(x, mask)], ClientConfig(), lambda *_: BOUND_S, push=push, padded=False,
                            relay_chain=chain)
    try:
        outcome = pipeline.run_blocking()
        ended = ("failed", {i: (type(e), str(e)) for i, e in outcome.failed.items()}, outcome.unsettled)
    except InvalidRequest as exc:
        ended = ("raised", type(exc), str(exc))
    state = [(h.written, len(h.outputs), [bytes(o.numpy()) if isinstance(o, torch.Tensor) else bytes(o.data)
                               for o in h.outputs], h.open_span.position, h.stream._step_id, h.stream.unanswered,
              h.stream.position, bytes(h.stream.call._buf), len(h.open_span.history)) for h in hops]
    for h, end in zip(hops, ends):
        h.stream.call.cancel()
        end.close()
    return ended, pipeline, chain, state


def _step(behaviours: list, in_c: bool, hidden: int = HIDDEN) -> dict:
    """One decode step over a route whose servers behave so: what it ended with, and each hop's state after it."""
    hops, ends = _route(behaviours)
    ended, pipeline, chain, state = route_step(hops, ends, in_c, False, hidden)
    return {"ended": ended, "hops": state, "timings": len(pipeline.timings),
            "answered_in_c": chain.answered if chain is not None else None}


@pytest.mark.parametrize("name", [n for n in BEHAVIOURS if n != "honest"])
@pytest.mark.parametrize("at", [0, 1, 2])
def test_a_hostile_or_broken_server_ends_the_step_as_the_python_path_ends_it(name, at):
    behaviours = [BEHAVIOURS["honest"]] * 3
    behaviours[at] = BEHAVIOURS[name]
    in_c, python = _step(behaviours, in_c=True), _step(behaviours, in_c=False)
    assert in_c["answered_in_c"] == at, "the chain took the hops before it, then stopped there"
    del in_c["answered_in_c"], python["answered_in_c"]
    assert in_c == python
    ended = in_c["ended"]
    expected = {"tampered": ServerTampered, "a byte changed": ServerTampered, "silent": ServerHung}.get(name, ServerFailed)
    if name == "refusal":
        assert ended == ("raised", InvalidRequest, "server-%d: no thanks" % at)
    else:
        assert ended[0] == "failed" and list(ended[1]) == [at] and issubclass(ended[1][at][0], expected)
        assert ended[1][at][0] is not ServerHung or str(BOUND_S) in ended[1][at][1]
    assert [h[1] for h in in_c["hops"]] == [1] * at + [0] * (3 - at), "the hops before it answered, none after"


def test_an_honest_route_answers_every_hop_in_the_chain_as_in_python():
    in_c, python = _step([BEHAVIOURS["honest"]] * 3, True), _step([BEHAVIOURS["honest"]] * 3, False)
    assert in_c.pop("answered_in_c") == 3
    python.pop("answered_in_c")
    assert in_c == python and in_c["ended"] == ("failed", {}, [])
    x = torch.arange(ROWS * HIDDEN, dtype=torch.float32)
    assert in_c["hops"][2][2] == [bytes((x + 3).numpy())], "each hop's output the next one's input"


@pytest.mark.parametrize("in_c, nth", [(True, 1), (False, 1), (True, 3)])
def test_a_tampered_answer_at_hop_2_of_3_bans_its_server_and_the_step_fails_over(tiny_bloom, monkeypatch, in_c, nth):
    """A live route of 3 (a spare for the middle span): the middle server's `nth` decode ANSWER changed on its way.
    The client bans that server as tampered (the longest ban) and replays onto the spare; the tokens stay
    transformers'. The same with the C chain as without it; the third answer is a relay lane's step (client/relay.py
    RelayLane: its chain stops at that hop and the usual path goes on from there; the servers answer in Python here,
    where the change is made)."""
    ids, want = greedy_reference(tiny_bloom, "a changed answer", 6)
    changed = {"n": 0}
    real = compact.answer_frame
    laned = []
    real_lane_step = RelayLane.step

    def answer_frame(key, session_id, *args, **kwargs):
        frame = real(key, session_id, *args, **kwargs)
        if session_id == changed.get("sid"):
            changed["n"] += 1
            if changed["n"] == nth:
                frame = compact.AnswerFrame(frame[:60] + bytes([frame[60] ^ 1]) + frame[61:])
        return frame

    def lane_step(lane, x):
        laned.append(lane.session.position)
        return real_lane_step(lane, x)

    monkeypatch.setattr(compact, "answer_frame", answer_frame)
    monkeypatch.setattr(RelayLane, "step", lane_step)
    with in_process_swarm(tiny_bloom, [BlockRange(0, 2), BlockRange(2, 4), BlockRange(2, 4), BlockRange(4, 6)],
                          step_lane=nth == 1) as swarm:
        client = client_of(swarm, frames=True, push=False, relay_in_c=in_c)
        try:
            with torch.no_grad(), client.inference_session(max_length=ids.shape[1] + 8) as session:
                logits = client.step_logits(session, ids)
                tokens = [int(logits[0, -1].argmax())]
                middle = session.spans[1].span.server_id
                changed["sid"] = session.spans[1].stream.session_id
                for _ in range(5):
                    logits = client.step_logits(session, torch.tensor([[tokens[-1]]]))
                    tokens.append(int(logits[0, -1].argmax()))
                assert changed["n"] >= nth and session.spans[1].span.server_id != middle
                ban = client.remote.view.bans[middle]
                assert ban.tampered and ban.failures == 1
                assert (session._relay is not None and session._relay.answered > 0) is in_c
                # each failover's step goes the usual way and arms the lane again; the step after it takes the lane
                p = ids.shape[1]
                assert laned == ([] if not in_c else [p + 2, p + 3, p + 4] if nth == 1 else [p + 1, p + 2, p + 4])
        finally:
            client.close()
    assert tokens == want


@pytest.mark.parametrize("at", [0, 2])
def test_a_server_that_takes_no_step_is_hung_after_its_bound_as_in_python(at):
    """A STEP larger than the socket's buffers to a server that reads nothing: the write waits for room at most the
    hop's bound, then the server is hung (the Python path's ServerHung, its STEP never wholly written)."""
    behaviours = [BEHAVIOURS["honest"]] * 3
    behaviours[at] = "deaf"
    hidden = 1 << 20  # (8 MB a STEP: more than a socket pair's buffers hold)
    in_c, python = _step(behaviours, True, hidden), _step(behaviours, False, hidden)
    assert in_c.pop("answered_in_c") == at
    python.pop("answered_in_c")
    assert in_c == python
    ended = in_c["ended"]
    assert list(ended[1]) == [at] and ended[1][at][0] is ServerHung and str(BOUND_S) in ended[1][at][1]
    assert in_c["hops"][at][0] == 0, "its STEP not written"
