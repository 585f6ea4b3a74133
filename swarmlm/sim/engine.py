"""The discrete-event loop: each event handles itself and returns the events it causes.

    while queue: time, event = pop(); new = event.handle(state); push(new)

Ordering is (time, sequence number): events at the same instant run in the order they were scheduled, so a run
is a pure function of its inputs and seed. There is one source of truth for ordering (the heap); events never
reorder themselves.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterable, Protocol, TypeVar

State = TypeVar("State")


class Event(Protocol[State]):
    """Anything with a time and a `handle(state)` that returns the events it causes (possibly none)."""

    time_s: float  # simulated time at which the event fires, in seconds since the start

    def handle(self, state: State) -> Iterable["Event[State]"] | None: ...


@dataclass(frozen=True)
class RunStats:
    events: int  # events handled
    end_time_s: float  # time of the last handled event
    stopped_early: bool  # True when `until_s` or `max_events` cut the run short


class EventLoop(Generic[State]):
    """A heap of pending events and a clock. The state is opaque to the engine."""

    def __init__(self, state: State) -> None:
        self.state = state
        self.now_s = 0.0
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = 0  # tie-breaker: FIFO among events scheduled for the same instant
        self.handled = 0

    def schedule(self, event: Event[State]) -> None:
        t = event.time_s
        if not math.isfinite(t):
            raise ValueError(f"event {type(event).__name__} has non-finite time {t}")
        if t < self.now_s:
            # an event in the past would silently reorder causality; that is always a bug in a handler
            raise ValueError(f"event {type(event).__name__} at {t:.9f}s is before the clock {self.now_s:.9f}s")
        heapq.heappush(self._heap, (t, self._seq, event))
        self._seq += 1

    def schedule_all(self, events: Iterable[Event[State]] | None) -> None:
        if events:
            for event in events:
                self.schedule(event)

    @property
    def pending(self) -> int:
        return len(self._heap)

    def run(
        self,
        until_s: float = math.inf,
        max_events: int | None = None,
        on_progress: Callable[[int, float], None] | None = None,
        progress_every: int = 20_000,
    ) -> RunStats:
        """Handle events in time order until none remain, the next one is after `until_s`, or `max_events`."""
        heap, state = self._heap, self.state
        pop, push = heapq.heappop, heapq.heappush
        limit = math.inf if max_events is None else max_events
        handled_here = 0
        while heap:
            if heap[0][0] > until_s or handled_here >= limit:
                return RunStats(self.handled, self.now_s, True)
            t, _, event = pop(heap)
            self.now_s = t
            new = event.handle(state)
            handled_here += 1
            self.handled += 1
            if new:
                # inlined schedule(): this loop runs millions of times in the scale benchmark
                for ev in new:
                    et = ev.time_s
                    if not t <= et < math.inf:  # also rejects NaN
                        raise ValueError(f"event {type(ev).__name__} at {et!r}s is not in [{t:.9f}s, inf)")
                    push(heap, (et, self._seq, ev))
                    self._seq += 1
            if on_progress is not None and self.handled % progress_every == 0:
                on_progress(self.handled, t)
        return RunStats(self.handled, self.now_s, False)
