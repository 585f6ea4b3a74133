"""Compact pushes (wire/compact.py PUSH_STEP, docs/PROTOCOL.md "Framed steps"): a plain decode step pushed to a
route's last server goes as a PUSH_STEP, with the same tokens as transformers and as a relayed route; its MAC is its
own domain; hostile ones are the attack suite's (tests/test_attacks.py, tests/test_fuzz_rpc.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from swarmlm.types import BlockRange
from swarmlm.wire import compact, session_keys
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire.frames import HEADER, Kind
from swarmlm.wire.session_keys import MAC_BYTES
from tests.swarm_helpers import client_of, greedy_reference, greedy_session, in_process_swarm

HIDDEN = 64  # tiny-bloom's
KEY, OTHER_KEY = b"p" * 32, b"q" * 32
SID, SECRET = "ab" * 16, b"s" * 16


def _values() -> bytes:
    return np.random.default_rng(0).standard_normal((1, 1, HIDDEN), dtype=np.float32).tobytes()


def test_a_push_step_reads_back_as_written_and_only_under_its_key():
    frame = compact.push_frame(KEY, SID, SECRET, 7, 1, 1, HIDDEN, _values())
    size, kind = HEADER.unpack_from(frame)
    assert kind == Kind.PUSH_STEP and size == len(frame) - HEADER.size
    push = compact.PushStep(frame[HEADER.size:])
    assert push.session_id == SID and push.secret == SECRET
    assert push.verified(KEY) and not push.verified(OTHER_KEY)
    step = push.step
    assert (step.step_id, step.b, step.t, step.h) == (7, 1, 1, HIDDEN) and step.nbytes == HIDDEN * 4
    assert step.values().tobytes() == _values()


def test_no_other_frames_mac_passes_for_a_push_steps_nor_a_push_steps_for_theirs():
    """The same key, the same session, the same bytes: a STEP's, an ANSWER's or a protobuf message's MAC is not a
    PUSH_STEP's, and a PUSH_STEP's is none of theirs (each its own BLAKE2b personalisation)."""
    frame = compact.push_frame(KEY, SID, SECRET, 7, 1, 1, HIDDEN, _values())
    body = frame[HEADER.size:-MAC_BYTES]
    for mac in (compact._tag(KEY, compact._STEP_PERSON, SID, body),
                compact._tag(KEY, compact._ANSWER_PERSON, SID, body), session_keys._mac_of(KEY, SID, body)):
        assert not compact.PushStep(body + mac).verified(KEY)
    assert compact.PushStep(frame[HEADER.size:]).verified(KEY)
    # the other way: a PUSH_STEP's STEP part with the PUSH_STEP's MAC is no STEP of that session under that key
    push_mac = frame[-MAC_BYTES:]
    step_part = bytes(compact.PushStep(frame[HEADER.size:]).step.body[:-MAC_BYTES])
    assert not compact.CompactStep(step_part + push_mac).verified(KEY, SID)
    step_frame = compact.step_frame(KEY, SID, 7, 1, 1, HIDDEN, _values())
    assert compact.CompactStep(step_frame[HEADER.size:]).verified(KEY, SID)  # (the STEP of the same values does)
    assert step_frame[-MAC_BYTES:] != push_mac


def test_a_short_or_undecodable_push_step_names_no_session():
    for body in (b"", b"\x05ab", b"\xff" * 80, bytes([2]) + b"\xff\xfe" + b"s" * 16 + b"\x00" * 40):
        push = compact.PushStep(body)
        assert push.session_id == "" and not push.verified(KEY)


def _tokens(client, ids: torch.Tensor, new: int, pushed: bool) -> list[int]:
    tokens, session = greedy_session(client, ids, new)
    for record in session.steps:  # (an ANSWER says it was pushed on as a REPLY does)
        assert [h.pushed for h in record.hops] == ([True, True, False] if pushed else [False] * 3)
    return tokens


@pytest.mark.parametrize("client_frames, keep_routes", [(True, False), (False, False), (False, True)])
def test_decode_pushes_to_the_last_server_go_compact_and_give_the_same_tokens(tiny_bloom, client_frames,
                                                                              keep_routes, monkeypatch):
    """3 servers, pushed, every step naming its whole route (no kept routes: on a gRPC stream the client keeps
    none, it writes no STEP there): every decode step's push from the middle server to the last is a PUSH_STEP (the
    first server's push carries the rest of the route: a PushRequest), and the greedy tokens equal transformers'
    and a relayed client's. On framed streams every decode step's three replies are ANSWERs, the two pushing
    servers' flagged pushed; on gRPC streams they are REPLYs (gRPC carries protobuf only). (Kept routes on framed
    streams: tests/test_kept_routes.py.)"""
    new = 6
    ids, want = greedy_reference(tiny_bloom, "compact pushes on the last hop", new)
    pushing_answers = []
    real = compact.answer_frame
    monkeypatch.setattr(compact, "answer_frame", lambda *a, **k: (pushing_answers.append(k.get("pushed_dims")),
                                                                  real(*a, **k))[1])
    # (the usual path's frames, which the pushers and answer_frame count: no step lanes, which take the last
    # server's PUSH_STEPs on their push connection once armed: tests/test_kept_routes.py)
    with in_process_swarm(tiny_bloom, [BlockRange(0, 2), BlockRange(2, 4), BlockRange(4, 6)], step_lane=False) as swarm:
        pushers = [s.service.pusher for s in swarm.servers]
        got = {}
        for push in (True, False):
            client = client_of(swarm, frames=client_frames, push=push, keep_routes=keep_routes)
            try:
                before = [p.compact_frames for p in pushers]
                pushing_answers.clear()
                got[push] = _tokens(client, ids, new, push)
                counts = [p.compact_frames - b for p, b in zip(pushers, before)]
            finally:
                client.close()
            flagged = sum(dims is not None for dims in pushing_answers)
            if push:
                # (the prefill's pushes stay PushRequests; each decode step's second push is compact)
                assert counts == [0, new - 1, 0], counts
                assert pushers[1].failed == 0
                assert (len(pushing_answers), flagged) == ((3 * (new - 1), 2 * (new - 1)) if client_frames else (0, 0))
            else:
                assert counts == [0, 0, 0] and flagged == 0
    assert got[True] == want and got[False] == want


def test_a_push_step_into_an_unkeyed_session_is_refused(tiny_bloom):
    """A PUSH_STEP's MAC is under the session's push key: a session opened without a key share has none, so no
    PUSH_STEP goes in (NotPermitted), whatever it carries."""
    import grpc

    from swarmlm.bench import frame_attacks as fa

    with in_process_swarm(tiny_bloom, [BlockRange(0, 2)]) as swarm:
        address = swarm.addresses[0]
        host, port = address.rsplit(":", 1)[0], fa.frame_port(address)
        with fa.KeyedStream.plain(host, port) as stream:
            stream.send(fa.HELLO + fa.open_request(2))
            kind, body = stream.frame()
            opened = pb.InferenceReply.FromString(body)
            assert kind == Kind.REPLY and opened.session_id
            frame = compact.push_frame(KEY, opened.session_id, opened.session_secret, 1, 1, 1, HIDDEN, _values())
            with fa.KeyedStream.plain(host, port) as pusher:
                answers = pusher.exchange(fa.PUSH_HELLO + frame)
            assert answers[0].startswith(f"REFUSED 1 {grpc.StatusCode.PERMISSION_DENIED.name} a PUSH_STEP must carry")
            assert stream.exchange(fa.END) == ["STATUS OK "]


def test_a_pushers_connection_takes_refusals_whenever_they_come_and_stays_usable():
    """A PUSH_STEP is not answered unless refused: its REFUSED (naming its step) may come at any time, alone, split
    across reads or just before a PUSH's STATUS; each goes to the pusher's `refused`, the STATUS to its push, and
    the connection stays usable. A REFUSED too short for its step id breaks the connection."""
    import grpc

    from swarmlm.server.frame_push import PushConnection
    from swarmlm.wire import frames

    class Transport:
        closed = False

        def is_closing(self) -> bool:
            return self.closed

        def close(self) -> None:
            self.closed = True

    refusals, answers = [], []
    conn = PushConnection(lambda *refusal: refusals.append(refusal))
    conn.connection_made(Transport())
    first = frames.refused(5, grpc.StatusCode.NOT_FOUND, "no stream holds session 'ab'")
    conn.data_received(first[:7])
    conn.data_received(first[7:])
    assert refusals == [(5, grpc.StatusCode.NOT_FOUND, "no stream holds session 'ab'")] and conn.usable()
    conn._answered = lambda c, code, details: answers.append(code)  # (a PUSH in flight, as `write` sets it)
    conn.data_received(frames.refused(6, grpc.StatusCode.PERMISSION_DENIED, "x") + frames.OK_STATUS)
    assert refusals[-1][:2] == (6, grpc.StatusCode.PERMISSION_DENIED) and answers == [grpc.StatusCode.OK]
    assert conn.usable()
    conn.data_received(frames.frame(frames.Kind.REFUSED, b"\x00\x01"))
    assert conn.broken and not conn.usable()
