"""Private swarms: every member holds one shared secret, the swarm key (a file, `--swarm-key FILE`).

Without the key a peer can neither announce nor be served:
- DHT records carry `swarm_mac` = HMAC(record key, subkey + expiration + record). swarmlm DHT nodes of the swarm refuse
  to store a record without a valid one (`swarm.validation.SwarmRecordValidator`) and readers drop it (`fetch_records`).
  A reader without the key that meets such records knows the swarm is private and says so (SwarmAccessDenied).
- Every gRPC call carries metadata `x-swarmlm-auth` = "v1.<unix time>.<nonce>.<HMAC(rpc key, method, time, nonce)>";
  servers refuse calls without a valid, fresh (AUTH_WINDOW_S), unreplayed token with UNAUTHENTICATED
  (server/auth.py). Clients and pushing servers add it with a channel interceptor (`client_interceptors`).
Record and RPC keys are derived from the swarm key (HMAC with a purpose label), so a token is never a record MAC.
The wire itself is not encrypted: the key keeps strangers out, it does not hide traffic from an eavesdropper.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import struct
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import grpc

from swarmlm.errors import SwarmAccessDenied

MIN_SWARM_KEY_BYTES = 16  # a shorter secret is refused: it could be guessed
AUTH_HEADER = "x-swarmlm-auth"
AUTH_WINDOW_S = 60.0  # a token older or newer than this (clock skew included) is refused
MAX_REMEMBERED_NONCES = 1 << 16  # tokens seen within the window (replays refused); the oldest are forgotten first
HINT = "pass the swarm key with --swarm-key FILE (or SWARMLM_SWARM_KEY_FILE)"


def load_swarm_key(path: str | Path) -> bytes:
    """The key in `path`: its bytes with surrounding whitespace stripped (a hex line from `create_swarm_key`)."""
    try:
        key = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the swarm key {path}: {exc.strerror}") from None
    if len(key) < MIN_SWARM_KEY_BYTES:
        raise ValueError(f"the swarm key in {path} has {len(key)} bytes, need at least {MIN_SWARM_KEY_BYTES}")
    return key


def create_swarm_key(path: str | Path) -> bytes:
    """A new random key (256 bits, written as hex) in a new file readable by its owner only."""
    key = os.urandom(32).hex().encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key + b"\n")
    return key


def _derived(swarm_key: bytes, purpose: bytes) -> bytes:
    return hmac.new(swarm_key, b"swarmlm/" + purpose, hashlib.sha256).digest()


# ---- DHT records ---------------------------------------------------------------------------------------------
MAC_FIELD = "swarm_mac"


def record_mac(swarm_key: bytes, subkey: str, expiration_time: float, value: dict[str, Any]) -> str:
    """The MAC of one record as stored: binds its content to the writer's subkey and its expiration."""
    # msgpack of the sorted items: the same bytes on both ends after a DHT round trip (ints stay ints, floats floats)
    from hivemind.utils import MSGPackSerializer

    body = MSGPackSerializer.dumps(sorted((k, v) for k, v in value.items() if k != MAC_FIELD))
    msg = struct.pack("!I", len(subkey.encode())) + subkey.encode() + struct.pack("!d", expiration_time) + body
    return hmac.new(_derived(swarm_key, b"record"), msg, hashlib.sha256).hexdigest()


def with_mac(swarm_key: bytes | None, subkey: str, expiration_time: float, value: dict[str, Any]) -> dict[str, Any]:
    if swarm_key is None:
        return value
    return {**value, MAC_FIELD: record_mac(swarm_key, subkey, expiration_time, value)}


def mac_ok(swarm_key: bytes, subkey: str, expiration_time: float, value: Any) -> bool:
    if not isinstance(value, dict) or not isinstance(value.get(MAC_FIELD), str):
        return False
    return hmac.compare_digest(value[MAC_FIELD], record_mac(swarm_key, subkey, expiration_time, value))


def refuse_keyless(where: str) -> SwarmAccessDenied:
    return SwarmAccessDenied(f"{where} belongs to a private swarm: {HINT}")


# ---- gRPC calls ----------------------------------------------------------------------------------------------
def make_token(swarm_key: bytes, method: str, now: float | None = None) -> str:
    ts = f"{time.time() if now is None else now:.3f}"
    nonce = os.urandom(12).hex()
    mac = hmac.new(_derived(swarm_key, b"rpc"), f"{method}\n{ts}\n{nonce}".encode(), hashlib.sha256).hexdigest()
    return f"v1.{ts}.{nonce}.{mac}"


class TokenChecker:
    """A server's check of `x-swarmlm-auth` tokens: valid MAC, fresh, not seen before."""

    def __init__(self, swarm_key: bytes, window_s: float = AUTH_WINDOW_S) -> None:
        self._key = _derived(swarm_key, b"rpc")
        self.window_s = window_s
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> token time, oldest first

    def check(self, method: str, token: str | None, now: float | None = None) -> str | None:
        """Why the call is refused, or None to let it in."""
        if not token:
            return "no swarm-key token"
        parts = token.split(".") if len(token) < 200 else []
        if len(parts) != 5 or parts[0] != "v1":  # "v1", seconds, milliseconds, nonce, mac
            return "malformed swarm-key token"
        ts_text, nonce, mac = f"{parts[1]}.{parts[2]}", parts[3], parts[4]
        want = hmac.new(self._key, f"{method}\n{ts_text}\n{nonce}".encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(mac, want):
            return "wrong swarm key"
        now = time.time() if now is None else now
        ts = float(ts_text)
        if abs(now - ts) > self.window_s:
            return f"stale swarm-key token ({now - ts:+.0f} s; clocks more than {self.window_s:.0f} s apart?)"
        if nonce in self._seen:
            return "replayed swarm-key token"
        self._seen[nonce] = ts
        while self._seen and (len(self._seen) > MAX_REMEMBERED_NONCES
                              or next(iter(self._seen.values())) < now - self.window_s):
            self._seen.popitem(last=False)
        return None


class _TokenMetadata:
    """Adds a fresh token to a call's metadata."""

    def __init__(self, swarm_key: bytes) -> None:
        self._swarm_key = swarm_key

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(AUTH_HEADER, make_token(self._swarm_key, method))
        return details._replace(metadata=metadata)


# grpc.aio files an interceptor under one call shape only: one class per shape the Swarm service has
class _UnaryToken(_TokenMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _StreamToken(_TokenMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


def client_interceptors(swarm_key: bytes | None) -> list:
    """For `grpc.aio.insecure_channel(..., interceptors=...)`: none in an open swarm."""
    return [] if swarm_key is None else [_UnaryToken(swarm_key), _StreamToken(swarm_key)]
