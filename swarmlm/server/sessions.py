"""Open sessions and the attention-cache budget. Running out of room is an expected refusal, not a crash."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from swarmlm.errors import CapacityExceeded, UnknownSession
from swarmlm.server.stage import SpanState


@dataclass
class Session:
    session_id: str
    state: SpanState
    batch: int
    max_length: int
    reserved_bytes: int
    last_used_s: float = field(default_factory=time.monotonic)


class SessionTable:
    """Sessions by id, with cache bytes reserved up front for each session's max length."""

    def __init__(self, cache_bytes: int, max_sessions: int) -> None:
        self.cache_bytes = cache_bytes
        self.max_sessions = max_sessions
        self.sessions: dict[str, Session] = {}

    @property
    def reserved_bytes(self) -> int:
        return sum(s.reserved_bytes for s in self.sessions.values())

    @property
    def free_bytes(self) -> int:
        return self.cache_bytes - self.reserved_bytes

    def open(self, state: SpanState, batch: int, max_length: int, nbytes: int) -> Session:
        if len(self.sessions) >= self.max_sessions:
            raise CapacityExceeded(f"server has {len(self.sessions)} sessions open, the limit is {self.max_sessions}")
        if nbytes > self.free_bytes:
            raise CapacityExceeded(
                f"session needs {nbytes} bytes of attention cache; {self.free_bytes} of {self.cache_bytes} are free"
            )
        session = Session(uuid.uuid4().hex, state, batch, max_length, nbytes)
        self.sessions[session.session_id] = session
        return session

    def get(self, session_id: str) -> Session:
        try:
            session = self.sessions[session_id]
        except KeyError:
            raise UnknownSession(f"session {session_id!r} is not open on this server") from None
        session.last_used_s = time.monotonic()
        return session

    def close(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)  # frees its cache tensors and its reservation

    def expire(self, idle_timeout_s: float) -> list[str]:
        now = time.monotonic()
        stale = [sid for sid, s in self.sessions.items() if now - s.last_used_s > idle_timeout_s]
        for sid in stale:
            self.close(sid)
        return stale
