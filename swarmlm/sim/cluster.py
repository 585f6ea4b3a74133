"""Simulated servers: a block range, a number of cache slots from the memory budget, and a queue of waiters.

One slot is one session's attention cache for one block (s_c bytes), so a session that runs k blocks on a
server holds k of its slots from admission to its last token: the paper's memory constraint
s_m * m_j + s_c * (block-sessions) <= M_j, enforced here as an integer count that is never exceeded.

Running out of slots is an expected outcome (`try_allocate` returns False), not an exception.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from swarmlm.sim.metrics import ServerUsage


def slots_from_memory(memory_bytes: float, block_bytes: float, cache_bytes: float, blocks: int) -> int:
    """floor((M - s_m * m) / s_c): block-sessions of cache that fit next to `blocks` blocks of weights."""
    if cache_bytes <= 0:
        raise ValueError(f"cache_bytes must be > 0, got {cache_bytes}")
    free = memory_bytes - block_bytes * blocks
    # a small relative tolerance so 10 GB / 1 GB is 10 slots, not 9 after float rounding
    return max(0, int(free / cache_bytes + 1e-9))


@dataclass(frozen=True)
class SimServerConfig:
    server_id: str
    start: int  # first block served
    end: int  # one past the last block served
    slots: int  # cache slots (block-sessions)

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"server {self.server_id}: empty block range [{self.start}, {self.end})")
        if self.slots < 0:
            raise ValueError(f"server {self.server_id}: slots must be >= 0, got {self.slots}")


class SimServer:
    """Slot accounting plus the time integrals that become utilisation and cache occupancy."""

    __slots__ = ("cfg", "used", "active", "waiters", "pending", "sessions", "compute_s", "busy_s", "slot_s",
                 "peak", "_last_s")

    def __init__(self, cfg: SimServerConfig) -> None:
        self.cfg = cfg
        self.used = 0  # slots held now
        self.active = 0  # sessions holding slots now
        self.waiters: deque[tuple[Any, int]] = deque()  # (session, slots it needs here), FIFO, in queue mode
        self.pending = 0  # slots promised to woken waiters whose retry has not run yet
        self.sessions = 0
        self.compute_s = 0.0
        self.busy_s = 0.0
        self.slot_s = 0.0
        self.peak = 0
        self._last_s = 0.0

    @property
    def free(self) -> int:
        return self.cfg.slots - self.used

    def _advance(self, now_s: float) -> None:
        # integrate occupancy up to now before the counts change
        dt = now_s - self._last_s
        if dt > 0:
            self.slot_s += self.used * dt
            if self.active:
                self.busy_s += dt
            self._last_s = now_s

    def try_allocate(self, slots: int, now_s: float) -> bool:
        if slots > self.free:
            return False
        self._advance(now_s)
        self.used += slots
        self.active += 1
        self.sessions += 1
        self.peak = max(self.peak, self.used)
        return True

    def release(self, slots: int, now_s: float) -> None:
        if slots > self.used or self.active < 1:
            raise AssertionError(f"server {self.cfg.server_id}: releasing {slots} slots but only {self.used} held")
        self._advance(now_s)
        self.used -= slots
        self.active -= 1

    def record(self, end_s: float) -> ServerUsage:
        self._advance(end_s)
        c = self.cfg
        return ServerUsage(c.server_id, c.start, c.end, c.slots, self.sessions, self.compute_s, self.busy_s,
                            self.slot_s, self.peak)


class Cluster:
    """All simulated servers by id; allocation of a whole route is all-or-nothing (no partial holds, no deadlock)."""

    def __init__(self, servers: list[SimServerConfig]) -> None:
        ids = [s.server_id for s in servers]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate server ids in {ids}")
        self.servers: dict[str, SimServer] = {s.server_id: SimServer(s) for s in servers}

    def first_short(self, needs: list[tuple[str, int]]) -> str | None:
        """The first server of `needs` [(server_id, slots)] without room, or None if all have room."""
        for sid, k in needs:
            if self.servers[sid].free < k:
                return sid
        return None

    def allocate(self, needs: list[tuple[str, int]], now_s: float) -> str | None:
        """Take slots on every server of `needs`, or none; returns the blocking server id on refusal."""
        short = self.first_short(needs)
        if short is not None:
            return short
        for sid, k in needs:
            ok = self.servers[sid].try_allocate(k, now_s)
            assert ok, f"server {sid} refused after first_short said it had room"
        return None

    def release(self, needs: list[tuple[str, int]], now_s: float) -> None:
        for sid, k in needs:
            self.servers[sid].release(k, now_s)

    def records(self, end_s: float) -> list[ServerUsage]:
        return [s.record(end_s) for s in self.servers.values()]
