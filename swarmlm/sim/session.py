"""A simulated client session: route, wait for cache slots, prefill, then decode token by token, then release.

Events (each returns the events it causes):
    Arrive -> attempt: route + all-or-nothing slot allocation
        refused: backoff mode -> Retry after min(initial * 2^(n-1), max) s, as the real client retries
                 queue mode   -> wait in the blocking server's FIFO, woken (Retry) when its slots free up
                 either way the client gives up after `timeout_s` (Timeout)
        admitted -> Token 1 after the prefill through every hop -> Token 2 ... -> the last Token releases the slots

Fidelity: a step's time through the route is computed analytically from the PerfModel (sum over hops of the
client<->server round trip with the hidden-state bytes, plus k blocks of compute at the server's load factor
f(b), b = the sessions holding slots there now). With the paper's GPU profiles f = 1: a step's time does not
depend on load, contention is for cache slots only, and the step is computed once per session. With CPU
profiles (f measured, `ComputeProfile.load_factor`) every token's step is timed at the load of its moment.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Literal, Protocol

from swarmlm.errors import SwarmError
from swarmlm.sim.arrivals import SimRequest
from swarmlm.sim.cluster import Cluster
from swarmlm.sim.metrics import STATUS_DONE, STATUS_TIMEOUT, RequestOutcome
from swarmlm.sim.routers import SimRouter
from swarmlm.types import Route

WaitMode = Literal["backoff", "queue"]

# SimSession.phase: a wake-up or timeout that finds the session in another phase is stale and does nothing
WAITING, QUEUED, RUNNING, ENDED = range(4)


@dataclass(frozen=True)
class ClientBehaviour:
    """How a simulated client waits for a server with no free slot (mirrors the real client's session)."""

    wait_mode: WaitMode = "backoff"  # backoff: retry with exponential backoff; queue: wake when slots free up
    retry_initial_s: float = 1.0  # first backoff delay, seconds (doubles each retry)
    retry_max_s: float = 60.0  # cap on one backoff delay, seconds (Petals uses 60)
    timeout_s: float = 600.0  # give up after waiting this long since arrival, seconds (finite: runs must end)

    def __post_init__(self) -> None:
        if self.wait_mode not in ("backoff", "queue"):
            raise ValueError(f"wait_mode must be backoff or queue, got {self.wait_mode!r}")
        if not 0 < self.retry_initial_s <= self.retry_max_s:
            raise ValueError(f"need 0 < retry_initial_s ({self.retry_initial_s}) <= retry_max_s ({self.retry_max_s})")
        if not (0 < self.timeout_s < math.inf):
            raise ValueError(f"timeout_s must be finite and > 0, got {self.timeout_s}")

    def backoff_s(self, attempts: int) -> float:
        """Delay before attempt `attempts + 1`, after `attempts` refusals."""
        return min(self.retry_initial_s * 2.0 ** min(attempts - 1, 60), self.retry_max_s)


class SimSession:
    """Mutable per-request state; touched only by this module's events and its host's admit/finish (SessionHost)."""

    __slots__ = ("req", "phase", "attempts", "queued_at", "route", "needs", "admitted_s", "first_s", "step_s",
                 "n_tokens")

    def __init__(self, req: SimRequest) -> None:
        self.req = req
        self.phase = WAITING
        self.attempts = 0  # admission attempts so far
        self.queued_at = ""  # server whose queue it waits in (queue mode, phase QUEUED)
        self.route: Route | None = None  # the route it was admitted on
        self.needs: list[tuple[str, int]] = []  # (server_id, slots) held while admitted
        self.admitted_s = math.nan  # when it got its slots
        self.first_s = math.nan  # when the first token reached the client
        self.step_s = 0.0  # one decode step through the route, seconds
        self.n_tokens = 0  # tokens delivered to the client so far


class SessionHost(Protocol):
    """What the session events read and call of the simulation's state (`simulator.SimState` is the one host).

    The events see only this surface, so this module never imports the simulator that schedules them."""

    cluster: Cluster
    router: SimRouter
    behaviour: ClientBehaviour
    contended: bool  # steps are timed one by one at the load of their moment
    token_events: bool  # one event per token (False: one for a whole decode)

    def admit(self, s: SimSession, route: Route, needs: list[tuple[str, int]], now_s: float) -> tuple[Token]: ...
    def step_s(self, s: SimSession) -> float: ...
    def finish(self, s: SimSession, now_s: float) -> list[Retry]: ...
    def enqueue(self, s: SimSession, server_id: str, need: int) -> None: ...
    def woken_done(self, server_id: str, need: int, now_s: float) -> list[Retry]: ...
    def unqueue(self, s: SimSession, now_s: float) -> list[Retry]: ...
    def record(self, s: SimSession, status: str, end_s: float) -> None: ...


def needs_of(route: Route) -> list[tuple[str, int]]:
    """Slots per server: one per block the session runs there (merged if a server appears twice)."""
    merged: dict[str, int] = {}
    for span in route.spans:
        merged[span.server_id] = merged.get(span.server_id, 0) + span.length
    return list(merged.items())


@dataclass(frozen=True, slots=True)
class Arrive:
    time_s: float
    req: SimRequest

    def handle(self, state: SessionHost) -> Iterable:
        return attempt(state, SimSession(self.req), self.time_s)


@dataclass(frozen=True, slots=True)
class Retry:
    """Try again: after a backoff delay, or woken from `woken_from`'s queue with `need` slots promised there."""

    time_s: float
    session: SimSession
    woken_from: str = ""
    need: int = 0

    def handle(self, state: SessionHost) -> Iterable:
        out: list = []
        if self.session.phase == WAITING:  # otherwise stale: gave up meanwhile
            out += attempt(state, self.session, self.time_s)
        if self.woken_from:
            out += state.woken_done(self.woken_from, self.need, self.time_s)
        return out


@dataclass(frozen=True, slots=True)
class Timeout:
    time_s: float
    session: SimSession

    def handle(self, state: SessionHost) -> Iterable:
        s = self.session
        if s.phase not in (WAITING, QUEUED):
            return ()  # admitted in time
        wake = state.unqueue(s, self.time_s) if s.phase == QUEUED else []
        s.phase = ENDED
        state.record(s, STATUS_TIMEOUT, self.time_s)
        return wake


@dataclass(frozen=True, slots=True)
class Token:
    """Token number `index` (1-based) reaches the client; the first one comes out of prefill."""

    time_s: float
    session: SimSession
    index: int

    def handle(self, state: SessionHost) -> Iterable:
        s = self.session
        s.n_tokens = self.index
        if self.index == 1:
            s.first_s = self.time_s
        l_out = s.req.output_tokens
        if self.index >= l_out:
            return state.finish(s, self.time_s)
        if state.contended:
            # the servers' load changes between tokens: time the next step at today's load
            s.step_s = state.step_s(s)
            return (Token(self.time_s + s.step_s, s, self.index + 1),)
        if not state.token_events:
            # one event for the whole decode: same times as per-token events, since nothing interrupts a step
            return (Token(s.first_s + (l_out - 1) * s.step_s, s, l_out),)
        # t_k = t_1 + (k-1) * step (multiplied, not accumulated, so long runs do not drift)
        return (Token(s.first_s + self.index * s.step_s, s, self.index + 1),)


def attempt(state: SessionHost, s: SimSession, now_s: float) -> Iterable:
    s.attempts += 1
    try:
        route = state.router.choose(s.req, now_s)
    except SwarmError:
        route = None  # no route right now (e.g. missing blocks): wait like a refusal
    if route is None:
        return _wait(state, s, now_s, "")
    needs = needs_of(route)
    blocked = state.cluster.allocate(needs, now_s)
    if blocked is None:
        return state.admit(s, route, needs, now_s)
    return _wait(state, s, now_s, blocked, dict(needs)[blocked])


def _wait(state: SessionHost, s: SimSession, now_s: float, blocked: str, need: int = 0) -> list:
    """Refused by `blocked` ("" = no route at all), which lacked `need` slots: queue there or back off.

    The one Timeout is armed at the first refusal; a session admitted before it fires makes it stale."""
    deadline = s.req.arrival_s + state.behaviour.timeout_s
    out: list = [Timeout(deadline, s)] if s.attempts == 1 else []
    if state.behaviour.wait_mode == "queue" and blocked:
        state.enqueue(s, blocked, need)
        return out
    retry_at = now_s + state.behaviour.backoff_s(s.attempts)
    if retry_at < deadline:
        out.append(Retry(retry_at, s))
    return out


def make_record(s: SimSession, status: str, end_s: float) -> RequestOutcome:
    r = s.req
    done = status == STATUS_DONE
    route = s.route if done else None
    return RequestOutcome(
        request_id=r.request_id,
        client_id=r.client_id,
        status=status,
        arrival_s=r.arrival_s,
        input_tokens=r.input_tokens,
        output_tokens=r.output_tokens,
        wait_s=(s.admitted_s if done else end_s) - r.arrival_s,
        start_s=s.admitted_s if done else math.nan,
        ttft_s=s.first_s - r.arrival_s if done else math.nan,
        per_token_s=(end_s - r.arrival_s) / r.output_tokens if done else math.nan,
        decode_per_token_s=(end_s - s.first_s) / (r.output_tokens - 1) if done and r.output_tokens > 1 else math.nan,
        finish_s=end_s,
        attempts=s.attempts,
        hops=len(route.spans) if route else 0,
        route=route.spans if route else (),
    )
