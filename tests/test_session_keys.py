"""End-to-end session keys (wire/session_keys.py, issue 39 hole 1): both ends derive the same keys, a MAC covers
every byte of a message and its session, and a push key opens only where it was sealed for."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from swarmlm.client.pipeline import OpenSpan
from swarmlm.server.sessions import Session
from swarmlm.wire import codec, session_keys
from swarmlm.wire import swarm_pb2 as pb


def _step(step_id: int = 1) -> pb.InferenceRequest:
    return pb.InferenceRequest(step=pb.InferenceStep(hidden=codec.encode(torch.randn(1, 2, 8)), step_id=step_id))


def _keyed() -> tuple[session_keys.SessionKeys, session_keys.SessionKeys]:
    server = session_keys.ServerKey()
    share, client = session_keys.client_keys(server.share)
    return client, server.keys(share)


def test_both_ends_derive_the_same_keys_and_each_open_gets_its_own():
    client, server = _keyed()
    assert client == server
    assert len({client.client, client.server, client.push, client.seal}) == 4
    other, _ = _keyed()
    assert other != client


def test_a_changed_byte_anywhere_in_a_message_fails_its_mac():
    keys, _ = _keyed()
    message = session_keys.sign(keys.client, "s1", _step())
    assert session_keys.verified(keys.client, "s1", message)
    raw = bytearray(message.SerializeToString())
    for i in range(len(raw)):  # every byte of the wire form (the MAC's own bytes too)
        changed = bytearray(raw)
        changed[i] ^= 0x80
        parsed = pb.InferenceRequest()
        try:
            parsed.ParseFromString(bytes(changed))
        except Exception:
            continue  # (no longer a message: refused as unparsable)
        assert not session_keys.verified(keys.client, "s1", parsed), i


def test_a_message_of_another_session_or_direction_or_without_mac_is_refused():
    keys, _ = _keyed()
    other, _ = _keyed()
    message = session_keys.sign(keys.client, "s1", _step())
    assert not session_keys.verified(other.client, "s1", message)  # replayed into another session
    assert not session_keys.verified(keys.client, "s2", message)  # another session id
    assert not session_keys.verified(keys.server, "s1", message)  # reflected back as the server's
    assert not session_keys.verified(keys.client, "s1", _step())  # no MAC at all


def test_a_push_key_opens_only_for_its_seal_key_and_session():
    pusher, _ = _keyed()
    target, _ = _keyed()
    sealed = session_keys.seal_push_key(pusher.seal, "t1", target.push)
    assert session_keys.open_push_key(pusher.seal, "t1", sealed) == target.push
    assert session_keys.open_push_key(target.seal, "t1", sealed) is None
    assert session_keys.open_push_key(pusher.seal, "t2", sealed) is None
    changed = bytearray(sealed)
    changed[20] ^= 1
    assert session_keys.open_push_key(pusher.seal, "t1", bytes(changed)) is None
    assert session_keys.open_push_key(pusher.seal, "t1", b"short") is None


def test_a_session_opens_the_same_sealed_push_key_once_and_nothing_else(monkeypatch):
    """A client seals a push key once per pair of sessions (OpenSpan.sealed_push_key); the pushing server's session
    opens those bytes once (Session.push_key), and still refuses a key not sealed for it, after a kept one too."""
    pusher, _ = _keyed()
    target, _ = _keyed()
    stranger, _ = _keyed()
    session = Session("s1", b"x" * 16, "peer", None, 1, 8, 0, keys=pusher)
    opened = []
    real = session_keys.open_push_key
    monkeypatch.setattr(session_keys, "open_push_key", lambda *a: opened.append(a) or real(*a))
    sealed = session_keys.seal_push_key(pusher.seal, "t1", target.push)
    assert session.push_key("t1", sealed) == target.push
    assert session.push_key("t1", sealed) == target.push and len(opened) == 1  # kept: not opened again
    assert session.push_key("t2", sealed) is None  # sealed for another next session
    assert session.push_key("t1", session_keys.seal_push_key(stranger.seal, "t1", target.push)) is None
    changed = bytearray(sealed)
    changed[20] ^= 1
    assert session.push_key("t1", bytes(changed)) is None
    assert session.push_key("t1", sealed) == target.push


def test_a_client_span_seals_a_next_sessions_push_key_once():
    pusher, _ = _keyed()
    target, _ = _keyed()
    span = OpenSpan(None, SimpleNamespace(keys=pusher, session_id="p1"))
    next_session = SimpleNamespace(keys=target, session_id="t1")
    sealed = span.sealed_push_key(next_session)
    assert span.sealed_push_key(next_session) == sealed  # the same bytes step after step
    assert session_keys.open_push_key(pusher.seal, "t1", sealed) == target.push
    other = span.sealed_push_key(SimpleNamespace(keys=target, session_id="t2"))  # a reopened next session
    assert other != sealed and session_keys.open_push_key(pusher.seal, "t2", other) == target.push


def test_a_key_share_that_is_not_a_key_is_refused():
    server = session_keys.ServerKey()
    for bad in (b"", b"x" * 31, bytes(32)):  # (all zeros: a low-order point, no shared secret)
        try:
            server.keys(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} accepted")


def _reply() -> pb.InferenceReply:
    return pb.InferenceReply(session_id="s1", step_id=7, hidden=codec.encode(torch.randn(1, 1, 8)), position=9,
                             pushed=True, timing=pb.Timing(queued_s=0.5, compute_s=0.25, batched_steps=2))


def test_signed_bytes_are_the_signed_message_serialized_once():
    """`signed_bytes` (a server's reply, serialized once with its MAC appended) gives the bytes of `sign` then
    `SerializeToString`, for every MACed message type, and leaves the message without a MAC."""
    keys, _ = _keyed()
    push = pb.PushRequest(session_id="s1", step=_step().step, secret=bytes(16))
    for message in (_reply(), _step(), push):
        want = session_keys.sign(keys.server, "s1", type(message).FromString(message.SerializeToString()))
        assert session_keys.signed_bytes(keys.server, "s1", message) == want.SerializeToString()
        assert not message.mac
    signed = session_keys.sign(keys.server, "s1", _reply())
    try:
        session_keys.signed_bytes(keys.server, "s1", signed)
    except ValueError:
        pass
    else:
        raise AssertionError("a message with a MAC signed again")


def test_a_mac_checked_on_the_message_bytes_passes_and_fails_as_the_reserialized_check():
    """`verified_bytes` (a framed request's MAC, checked on the bytes it came in) answers as `verified` for every
    changed byte, for the wrong key or session, and for a MAC that is not the last field (checked the slow way)."""
    keys, _ = _keyed()
    raw = session_keys.signed_bytes(keys.client, "s1", _step())
    message = pb.InferenceRequest.FromString(raw)
    assert session_keys.verified_bytes(keys.client, "s1", message, raw)
    assert not session_keys.verified_bytes(keys.client, "s2", message, raw)
    assert not session_keys.verified_bytes(keys.server, "s1", message, raw)
    for i in range(len(raw)):
        changed = bytearray(raw)
        changed[i] ^= 0x80
        try:
            parsed = pb.InferenceRequest.FromString(bytes(changed))
        except Exception:
            continue
        assert session_keys.verified_bytes(keys.client, "s1", parsed, bytes(changed)) == \
            session_keys.verified(keys.client, "s1", parsed), i
    mac_first = raw[-18:] + raw[:-18]  # the same message, its MAC first: valid protobuf, checked re-serialized
    assert session_keys.verified_bytes(keys.client, "s1", pb.InferenceRequest.FromString(mac_first), mac_first)
    unsigned = _step().SerializeToString()
    assert not session_keys.verified_bytes(keys.client, "s1", pb.InferenceRequest.FromString(unsigned), unsigned)
