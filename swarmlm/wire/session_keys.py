"""End-to-end session keys (issue 39, hole 1): a session is keyed by the server's identity, not by the honesty of
the relays or proxies between the two ends (docs/PROTOCOL.md, "Session keys").

- A server holds a static X25519 key (one per process); its public half, `key_share`, is in the Info it signs with
  its identity key (swarm/identity.py), which clients check before they route to it.
- A client opening a session sends an ephemeral X25519 public key (`OpenSession.key_share`); both ends derive the
  session's keys with HKDF-SHA256 over the shared secret and both shares. Each open has a fresh client key, so no
  two sessions share keys: a message of one session fails the other's check.
- Every message of a keyed session carries `mac`: keyed BLAKE2b (16 bytes) of the session id and its deterministic
  serialization (mac left empty), each direction under its own key. The open is MACed too (with session id
  ""), so a relay that swaps the key share or edits the open is caught at the client's first reply check.
- Pushes into a session are MACed under its push key; the client hands that key to the server that pushes there,
  sealed under that server's own session's seal key (ChaCha20-Poly1305), so a relay on the way sees MACs only.

A relay can still drop, delay or cut a stream (a failover then), but it cannot change a hidden state, a cache op,
a push target or a reply without the receiving end refusing it.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import os
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

KEY_SHARE_BYTES = 32  # an X25519 public key
MAC_BYTES = 16  # keyed BLAKE2b's digest size
_NONCE_BYTES = 12  # ChaCha20-Poly1305
SEALED_KEY_BYTES = _NONCE_BYTES + 32 + 16  # nonce + push key + tag
_DOMAIN = b"swarmlm-session-keys-v1"
TAMPERED = "MAC does not match the session's key"  # in a server's refusal of a changed message (the client bans)
REPLY_TAMPERED = f"a reply's {TAMPERED}: changed on the way (its relay?) or a bad server"


@dataclass(frozen=True)
class SessionKeys:
    """One session's keys (32 bytes each), the same at both ends."""

    client: bytes  # MACs the client's messages (open, steps, saves)
    server: bytes  # MACs the server's replies
    push: bytes  # MACs pushes into this session (the previous server of the route holds it)
    seal: bytes  # seals the push keys of the sessions this session's server pushes to

    def __repr__(self) -> str:  # (never in a log)
        return "SessionKeys(...)"


def _derive(shared: bytes, client_share: bytes, server_share: bytes) -> SessionKeys:
    okm = HKDF(hashes.SHA256(), 128, salt=None, info=_DOMAIN + client_share + server_share).derive(shared)
    return SessionKeys(okm[:32], okm[32:64], okm[64:96], okm[96:])


def _public(private: X25519PrivateKey) -> bytes:
    return private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


class ServerKey:
    """A server's static X25519 key: `share` goes into its signed Info; `keys` answers a client's open."""

    def __init__(self) -> None:
        self._private = X25519PrivateKey.generate()
        self.share = _public(self._private)

    def keys(self, client_share: bytes) -> SessionKeys:
        """The keys of a session opened with `client_share`; ValueError for a share that is not an X25519 key."""
        if len(client_share) != KEY_SHARE_BYTES:
            raise ValueError(f"a key share is {KEY_SHARE_BYTES} bytes, got {len(client_share)}")
        # (a low-order point gives no shared secret: ValueError)
        shared = self._private.exchange(X25519PublicKey.from_public_bytes(bytes(client_share)))
        return _derive(shared, bytes(client_share), self.share)


def client_keys(server_share: bytes) -> tuple[bytes, SessionKeys]:
    """A fresh client key share for an open to the server whose signed Info gave `server_share`, and the session's
    keys; ValueError for a share that is not an X25519 key."""
    if len(server_share) != KEY_SHARE_BYTES:
        raise ValueError(f"a key share is {KEY_SHARE_BYTES} bytes, got {len(server_share)}")
    private = X25519PrivateKey.generate()
    shared = private.exchange(X25519PublicKey.from_public_bytes(bytes(server_share)))
    share = _public(private)
    return share, _derive(shared, share, bytes(server_share))


def mac(key: bytes, session_id: str, message) -> bytes:
    """The MAC of a message (InferenceRequest, InferenceReply or PushRequest) of session `session_id`: over its
    deterministic serialization with `mac` empty (every other field, unknown ones included)."""
    held = message.mac
    if held:
        message.mac = b""
    try:
        data = message.SerializeToString(deterministic=True)
    finally:
        if held:
            message.mac = held
    return _mac_of(key, session_id, data)


def _mac_of(key: bytes, session_id: str, data) -> bytes:
    """The MAC of a message of session `session_id` serialized (with `mac` empty) as `data`."""
    # keyed BLAKE2b (RFC 7693's MAC mode): ~5 us right after a forward, where HMAC-SHA256 through OpenSSL took ~30
    # (4 MACs per hop: docs/RESULTS-hop.md round 10)
    digest = hashlib.blake2b(session_id.encode() + b"\n", digest_size=MAC_BYTES, key=key)
    digest.update(data)
    return digest.digest()


def sign(key: bytes, session_id: str, message):
    """Set `message.mac`; returns the message."""
    message.mac = mac(key, session_id, message)
    return message


def signed_bytes(key: bytes, session_id: str, message) -> bytes:
    """The wire form of `message` (its `mac` empty) with its MAC: the same bytes as `sign` then `SerializeToString`,
    serialized once. `mac` is the last field of every MACed message, so its encoding follows the rest (a
    message serializes its fields in number order; the receiver's check re-serializes, so any order would do)."""
    if message.mac:
        raise ValueError("signed_bytes: the message carries a MAC already")
    data = message.SerializeToString(deterministic=True)
    return data + _mac_tag(type(message)) + _mac_of(key, session_id, data)


def verified(key: bytes, session_id: str, message) -> bool:
    """Does the message carry the right MAC (a missing one is wrong)?"""
    return len(message.mac) == MAC_BYTES and hmac.compare_digest(message.mac, mac(key, session_id, message))


def verified_bytes(key: bytes, session_id: str, message, data: bytes) -> bool:
    """`verified` for a message parsed from `data`, checked on those bytes when they end with its MAC's field (as
    every sender's serialization does: `signed_bytes`): the MAC of the bytes before that field, no re-serialization.
    Any other layout (or a mismatch there) is checked as `verified` does: the same messages pass either way (the
    key's holder MACed exactly the bytes before its MAC, which parse to the message with its MAC empty)."""
    tag = _mac_tag(type(message))
    size = len(data) - len(tag) - MAC_BYTES
    if size >= 0 and data[size:size + len(tag)] == tag:
        view = memoryview(data)
        if hmac.compare_digest(view[size + len(tag):], _mac_of(key, session_id, view[:size])):
            return True
    return verified(key, session_id, message)


@functools.cache
def _mac_tag(message_type) -> bytes:
    """The bytes that open the `mac` field of a message type: its tag and length."""
    number = message_type.DESCRIPTOR.fields_by_name["mac"].number
    assert number < 16, "a mac field number of one tag byte"
    return bytes([number << 3 | 2, MAC_BYTES])  # (field number < 16: one tag byte; length 16: one byte)


def seal_push_key(seal: bytes, session_id: str, push_key: bytes) -> bytes:
    """`push_key` (of the session `session_id` on the next server) for the server holding the seal key `seal`."""
    nonce = os.urandom(_NONCE_BYTES)
    return nonce + ChaCha20Poly1305(seal).encrypt(nonce, push_key, session_id.encode())


def open_push_key(seal: bytes, session_id: str, sealed: bytes) -> bytes | None:
    """The push key `seal_push_key` sealed, or None if it was not sealed under `seal` for `session_id`."""
    if len(sealed) != SEALED_KEY_BYTES:
        return None
    try:
        return ChaCha20Poly1305(seal).decrypt(sealed[:_NONCE_BYTES], sealed[_NONCE_BYTES:], session_id.encode())
    except InvalidTag:
        return None
