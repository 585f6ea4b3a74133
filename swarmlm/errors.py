"""The few errors a swarmlm user sees. Capacity limits are typed refusals, not crashes."""
from __future__ import annotations


class SwarmError(Exception):
    """Base of every swarmlm error."""


class InvalidRequest(SwarmError, ValueError):
    """A request is malformed (shape, dtype, length, size). Nothing was changed."""


class PushRefused(InvalidRequest):
    """A server refused to push a step on to the next server of the route (it does not see that server announced
    there: it just moved, or this server's own DHT reads fail). Nothing was computed: the client sends the step
    itself (wire code PUSH_REFUSED)."""


class CapacityExceeded(SwarmError):
    """A server refused work it has no room for (cache budget, session count). Try another server or later."""


class MemoryBudgetExceeded(SwarmError, ValueError):
    """A server was asked for more blocks than its memory budget holds; it says so before loading anything."""


class UnknownSession(SwarmError, KeyError):
    """The session id is not open on this server (never opened, closed, or expired)."""


class NotPermitted(SwarmError):
    """A peer asked for something it may not do here (a session's step or push without the session's secret)."""


class MissingBlocks(SwarmError):
    """No live server covers some blocks of the model."""

    def __init__(self, missing: list[int], detail: str = "") -> None:
        self.missing = missing
        ranges = block_ranges(missing)
        super().__init__(f"no server in the swarm serves blocks {ranges}" + (f" ({detail})" if detail else ""))


class ServerFailed(SwarmError):
    """A server of the route stopped answering or returned an error; the session may fail over."""

    def __init__(self, server_id: str, reason: str) -> None:
        self.server_id = server_id
        super().__init__(f"server {server_id} failed: {reason}")


class ServerHung(ServerFailed):
    """A server is alive (its stream did not break) but sent no reply within its hang timeout: a failure of it."""

    def __init__(self, server_id: str, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        super().__init__(server_id, f"hung: no reply within {timeout_s:.1f} s")


class ServerTampered(ServerFailed):
    """A message of a keyed session failed its MAC check (wire/session_keys.py), at the client or at the server: it
    was changed on the way (the server's relay?) or the server is bad. Banned for the longest ban, and not let back
    by a passing connect check (the check does not go through what changed the message)."""


class SwarmAccessDenied(SwarmError):
    """This peer lacks what the swarm requires (a private swarm's key): nothing will work until it has it."""


class PlanningError(SwarmError, ValueError):
    """A topology or placement request cannot be satisfied (unknown names, not enough memory, uncovered blocks)."""


def block_ranges(blocks: list[int]) -> str:
    """[0,1,2,5] -> '0-2, 5'."""
    out: list[str] = []
    for b in sorted(set(blocks)):
        if out and b == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{b}"
        else:
            out.append(str(b))
    return ", ".join(out)
