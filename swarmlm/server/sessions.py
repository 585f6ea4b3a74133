"""Open sessions, who holds them, and the attention-cache budget. Running out of room is an expected refusal.

A session belongs to its opener: the open reply carries a random 128-bit secret, sent only on the opener's stream;
push and resume must show it. A session costs no cache until its first step runs (then its whole reservation for
`max_length` tokens is taken), so opening sessions is cheap and cannot lock the cache; opens that never step expire
within seconds. Per-peer quotas (a peer is a remote host) bound what one host can hold: sessions, and request bytes
received and not yet answered.
"""
from __future__ import annotations

import asyncio
import hmac
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from swarmlm.errors import CapacityExceeded, UnknownSession
from swarmlm.kernels.frame_types import FrameKey
from swarmlm.server.prefix_cache import PrefixCache
from swarmlm.server.stage import SpanState
from swarmlm.wire import session_keys
from swarmlm.wire.compact import SECRET_BYTES  # 128 bits (a PUSH_STEP carries it: wire/compact.py)
from swarmlm.wire.session_keys import SessionKeys



@dataclass
class Session:
    session_id: str
    secret: bytes
    owner: str  # the host that opened it (quotas count per host)
    state: SpanState
    batch: int
    max_length: int
    needed_bytes: int  # cache for max_length tokens, reserved at the first step
    reserved_bytes: int = 0
    stepped: bool = False  # a step was admitted (its cache reserved); until then it expires after open_idle_s
    open_idle_s: float = 10.0  # how long after its open its first step may come (ServerConfig.open_idle_limit_s)
    opened_s: float = field(default_factory=time.monotonic)
    last_used_s: float = field(default_factory=time.monotonic)  # its last step's arrival, then that step's end
    detached_s: float | None = None  # when its stream broke; None while a stream holds it (or before)
    prefix_digest: bytes | None = None  # the prefix-cache scope named at open (server/prefix_cache.py)
    keys: SessionKeys | None = None  # end-to-end keys (wire/session_keys.py); None: an unkeyed session, no MACs
    # held by a framed stream (server/frame_server.py): a compact step pushed here (PUSH_STEP) is answered by an
    # ANSWER frame; on a gRPC stream by a REPLY (gRPC carries only protobuf messages)
    framed: bool = False
    # its server key as the one-call answer takes it (kernels/lane.py), made at its first such answer
    answer_key: FrameKey | None = field(default=None, repr=False)
    # no step lane can ever serve it (unkeyed, an adapter or a deep prompt, blocks without a one-call decoder, limits
    # that refuse its last positions: server/lane.py): not asked again at every step
    lane_never: bool = False
    # its armed step lane (server/lane.py): its steps pass no Python, so their time is the lane's (`last_active_s`)
    lane: object = field(default=None, repr=False)
    # its kept routes (server/push.py KeptRoute, protocol 4): where its plain decode steps from its stream (compact
    # STEPs) and from pushes (PUSH_STEPs) go on; None: not pushed on
    stream_route: object = field(default=None, repr=False)
    push_route: object = field(default=None, repr=False)
    # the push key opened last: (sealed, the next server's session, key); a client seals one per route, not per step
    _opened_push_key: tuple[bytes, str, bytes] | None = field(default=None, repr=False)

    def last_active_s(self) -> float:
        """When its last step ended (or arrived, or it was opened): time.monotonic."""
        return self.last_used_s if self.lane is None else self.lane.last_step_s

    def owned_by(self, secret: bytes) -> bool:
        return hmac.compare_digest(self.secret, bytes(secret))

    def push_key(self, target_session: str, sealed: bytes) -> bytes | None:
        """The push key of `target_session` (on the next server) that a step's push target carries sealed for this
        session's server (`session_keys.open_push_key`), or None if it was not sealed for us. The same sealed bytes
        step after step are opened once (a ChaCha20-Poly1305 decryption each pushed step, cold, otherwise)."""
        last = self._opened_push_key
        if last is not None and last[1] == target_session and hmac.compare_digest(last[0], sealed):
            return last[2]
        key = session_keys.open_push_key(self.keys.seal, target_session, sealed)
        if key is not None:
            self._opened_push_key = (bytes(sealed), target_session, key)
        return key


def _nothing(session_id: str | None) -> None:
    pass


class SessionTable:
    """Sessions by id; cache bytes are reserved for a session's max length when its first step runs."""

    def __init__(self, cache_bytes: int, max_sessions: int, max_sessions_per_peer: int | None = None,
                 max_peer_cache_bytes: int | None = None, prefixes: PrefixCache | None = None) -> None:
        self.cache_bytes = cache_bytes
        self.prefixes = prefixes  # cached prefixes share cache_bytes, and give way to reservations
        self.max_sessions = max_sessions
        self.max_sessions_per_peer = max_sessions_per_peer or max_sessions
        self.max_peer_cache_bytes = max_peer_cache_bytes or cache_bytes  # what one host's sessions may reserve
        self.sessions: dict[str, Session] = {}
        # told of every open (None) and every close or detach (its id) before it happens: a step lane (server/lane.py)
        # holds a session's caches and runs only while its session is alone here
        self.changing: Callable[[str | None], None] = _nothing

    @property
    def reserved_bytes(self) -> int:
        return sum(s.reserved_bytes for s in self.sessions.values())

    @property
    def free_bytes(self) -> int:
        """What a new session's reservation can take (cached prefixes are evicted to make room)."""
        return self.cache_bytes - self.reserved_bytes

    @property
    def held_bytes(self) -> int:
        """Reservations plus cached prefixes: never above cache_bytes."""
        return self.reserved_bytes + (self.prefixes.bytes if self.prefixes is not None else 0)

    def held_by(self, owner: str) -> int:
        return sum(1 for s in self.sessions.values() if s.owner == owner)

    def open(self, owner: str, state: SpanState, batch: int, max_length: int, nbytes: int,
             open_idle_s: float = 10.0) -> Session:
        if len(self.sessions) >= self.max_sessions:
            raise CapacityExceeded(f"server has {len(self.sessions)} sessions open, the limit is {self.max_sessions}")
        if self.held_by(owner) >= self.max_sessions_per_peer:
            raise CapacityExceeded(f"peer {owner} holds {self.max_sessions_per_peer} sessions here, the per-peer limit")
        if nbytes > self.max_peer_cache_bytes:
            raise CapacityExceeded(f"session needs {nbytes} bytes of attention cache, over the per-peer limit of "
                                   f"{self.max_peer_cache_bytes} (the server has {self.cache_bytes})")
        self.changing(None)
        session = Session(uuid.uuid4().hex, secrets.token_bytes(SECRET_BYTES), owner, state, batch, max_length, nbytes,
                          open_idle_s=open_idle_s)
        self.sessions[session.session_id] = session
        return session

    def reserve(self, session: Session) -> None:
        """Take the session's cache reservation (at its first step); CapacityExceeded if it does not fit."""
        if session.reserved_bytes:
            return
        if session.needed_bytes > self.free_bytes:
            raise CapacityExceeded(
                f"session needs {session.needed_bytes} bytes of attention cache; {self.free_bytes} of "
                f"{self.cache_bytes} are free"
            )
        held = sum(s.reserved_bytes for s in self.sessions.values() if s.owner == session.owner)
        if held + session.needed_bytes > self.max_peer_cache_bytes:
            raise CapacityExceeded(
                f"session needs {session.needed_bytes} bytes of attention cache; peer {session.owner} holds {held} "
                f"of its per-peer limit {self.max_peer_cache_bytes}"
            )
        if self.prefixes is not None:  # a live session wins: cached prefixes make room
            self.prefixes.shrink_to(self.free_bytes - session.needed_bytes)
        session.reserved_bytes = session.needed_bytes

    def get(self, session_id: str) -> Session:
        try:
            session = self.sessions[session_id]
        except KeyError:
            raise UnknownSession(f"session {session_id[:80]!r} is not open on this server") from None
        session.last_used_s = time.monotonic()
        return session

    def close(self, session_id: str) -> None:
        self.changing(session_id)
        self.sessions.pop(session_id, None)  # frees its cache tensors and its reservation

    def detach(self, session_id: str) -> None:
        """Its stream broke: it is closed after the resume grace unless a stream resumes it."""
        self.changing(session_id)
        session = self.sessions.get(session_id)
        if session is not None:
            session.detached_s = time.monotonic()

    def expire(self, idle_timeout_s: float, resume_grace_s: float) -> list[str]:
        """Close sessions idle too long, opened and never stepped past their open_idle_s, or detached past the
        grace."""
        now = time.monotonic()

        def stale(s: Session) -> bool:
            return (now - s.last_active_s() > idle_timeout_s
                    or (not s.stepped and now - s.opened_s > s.open_idle_s)
                    or (s.detached_s is not None and now - s.detached_s > resume_grace_s))

        gone = [sid for sid, s in self.sessions.items() if stale(s)]
        for sid in gone:
            self.close(sid)
        return gone


class PeerBytes:
    """Request bytes per peer received and not yet answered. One message alone always fits (gRPC bounds its size);
    beyond `limit`, streams wait (HTTP/2 flow control holds the sender back) and unary calls are refused."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held: dict[str, int] = {}  # (a plain dict: Counter's missing keys cost a Python call each, per step)
        self._freed = asyncio.Condition()
        self._waiting = 0  # adds waiting for room: a release wakes them (none: no wake-up task per release)

    def try_add(self, peer: str, nbytes: int) -> bool:
        held = self.held.get(peer, 0)
        if held and held + nbytes > self.limit:
            return False
        self.held[peer] = held + nbytes
        return True

    async def add(self, peer: str, nbytes: int) -> None:
        if self.try_add(peer, nbytes):
            return
        self._waiting += 1
        try:
            async with self._freed:
                await self._freed.wait_for(lambda: self.try_add(peer, nbytes))
        finally:
            self._waiting -= 1

    def release(self, peer: str, nbytes: int) -> None:
        left = self.held.get(peer, 0) - nbytes
        if left > 0:
            self.held[peer] = left
        else:
            self.held.pop(peer, None)
        if self._waiting:
            asyncio.ensure_future(self._notify())

    async def _notify(self) -> None:
        async with self._freed:
            self._freed.notify_all()
