"""Bounded spin-then-block waits on the decode hop (docs/ARCHITECTURE.md, "Waits").

On this project's measured machine (a KVM guest whose idle vCPU halts, shared with other processes), a process that
sleeps through a 5-100 ms wait comes back cold: every Python call of the next message's path costs 10-40x its warm
time, 1.2-1.5 ms per hop (docs/RESULTS-hop.md, rounds 11-12). A wait that first polls its sockets without
sleeping (kernels/spin.c: poll with a zero timeout + sched_yield, the GIL released, at SCHED_IDLE so that any real
work preempts it) keeps its CPU and its caches, for a bounded budget; then it blocks as before.

Never on an idle machine: the client spins only inside a step's wait for its reply (`FrameCall`, up to the client's
`spin_wait_s` per wait); a server's loop spins only within a window after framed traffic (`SpinWindow`: a few times
the recent gap between its steps, at most the server's `spin_wait_s`), so a server that no session uses sleeps.
Where a thread may not leave SCHED_IDLE again (no CAP_SYS_NICE and RLIMIT_NICE 0) or the kernels cannot be built,
nothing spins: a spin at the normal class takes the CPU a server on the same machine needs (round 10 measured steps
2-4x slower at load ~4).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import selectors
import select
import threading
import time
from collections import deque

log = logging.getLogger(__name__)

# a server's window after its last framed data: this many times the longest recent gap between arrivals (a session's
# steps come at its token time: the window outlasts one missed beat, then the loop sleeps again), at most spin_wait_s
GAP_FACTOR = 3.0
GAPS_KEPT = 8  # recent gaps between arrivals the window is derived from


class PollFd(ctypes.Structure):  # struct pollfd (poll(2))
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


@functools.lru_cache(maxsize=1)
def may_leave_idle_class() -> bool:
    """Can a thread of this process go to SCHED_IDLE and back to SCHED_OTHER? (Back needs CAP_SYS_NICE or an
    RLIMIT_NICE that allows nice 0.) Tried once, on a throwaway thread: a thread stuck at SCHED_IDLE would run only
    when nothing else wants its CPU."""
    ok = []

    def attempt() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # (Linux: this thread only)
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            ok.append(True)
        except (OSError, AttributeError):
            pass

    thread = threading.Thread(target=attempt, name="swarmlm-spin-check", daemon=True)
    thread.start()
    thread.join()
    return bool(ok)


@functools.lru_cache(maxsize=1)
def _spin_poll():
    """kernels/spin.c's spin_poll, or None: nothing spins in this process (see the module's docstring)."""
    if not may_leave_idle_class():
        return None
    from swarmlm import kernels

    return kernels.library().spin_poll if kernels.available() else None


def can_spin() -> bool:
    return _spin_poll() is not None


def spin_poll(waits: list[tuple[int, int]], budget_s: float) -> bool:
    """Poll (file descriptor, poll events) pairs without sleeping, at SCHED_IDLE, for at most `budget_s`: True as
    soon as one is ready (its events, or an error or hang-up), False when the budget is spent (or nothing may spin)."""
    spin = _spin_poll()
    if spin is None or budget_s <= 0 or not waits:
        return False
    fds = (PollFd * len(waits))(*[PollFd(fd, events, 0) for fd, events in waits])
    got = spin(ctypes.addressof(fds), len(waits), int(budget_s * 1e9), 1)
    if got == -2:  # (its limits changed since the check): this thread now runs only when nothing else wants a CPU
        log.error("a thread could not leave SCHED_IDLE after a spin: it now runs at idle priority")
    return got > 0


class SpinWindow:
    """When a server's loop may spin: within a window after the last `note` (framed data arrived), the window
    GAP_FACTOR x the longest of the recent gaps between notes, at most `max_s` (0: never). One object per server,
    used from its loop thread only."""

    def __init__(self, max_s: float) -> None:
        self.max_s = max_s
        self._gaps: deque[float] = deque(maxlen=GAPS_KEPT)  # gaps shorter than max_s (longer: a session's start)
        self._last = float("-inf")
        self._until = float("-inf")  # monotonic time the window closes

    def note(self, now: float) -> None:
        if self.max_s <= 0:
            return
        gap = now - self._last
        self._last = now
        if gap < self.max_s:
            self._gaps.append(gap)
        window = min(self.max_s, GAP_FACTOR * max(self._gaps)) if self._gaps else self.max_s
        self._until = now + window

    def budget(self, now: float) -> float:
        """Seconds a wait starting now may spin (0: the window is closed)."""
        return max(0.0, self._until - now)


class SpinningSelector(selectors.EpollSelector):
    """An epoll selector whose waits first spin (spin_poll on the epoll descriptor itself: readable when any of its
    descriptors is ready) while `window` is open, then block for the rest of the timeout as before. The same events
    and the same timeouts as EpollSelector."""

    def __init__(self, window: SpinWindow) -> None:
        super().__init__()
        self.window = window

    def select(self, timeout: float | None = None):
        if timeout is None or timeout > 0:
            start = time.monotonic()
            budget = self.window.budget(start)
            if budget > 0:
                if spin_poll([(self.fileno(), select.POLLIN)], budget if timeout is None else min(budget, timeout)):
                    timeout = 0
                elif timeout is not None:
                    timeout = max(0.0, timeout - (time.monotonic() - start))
        return super().select(timeout)
