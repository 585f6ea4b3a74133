"""Decode-first transmission: which message is written next on each link (one link = one server address).

Used by the client (client/streams.py, policy from its config: `TransmissionPolicy.for_client`) and by a server pushing
outputs on to the next server (server/push.py): both write steps of many sessions to one peer.

All sessions' messages to one server share one gRPC channel, one TCP connection, one emulated or real link. Bytes
written there leave in order, so a one-token decode message written after a prefill waits for the whole prefill
to cross the link (MoLink measured hundreds of times the uncontended delay). The scheduler therefore keeps the
messages that are not written yet and decides at every write:

  * decode first: a waiting decode message (one new token per sequence) is written before waiting prefill chunks;
  * fairness: at most `max_decode_burst` decode messages in a row pass a prefill chunk that could have gone, then
    the chunk goes, so a steady stream of decodes from many sessions cannot starve a prefill;
  * a prefill window: at most `prefill_window` prefill messages per link are written and not yet answered. The
    server works on one of them while the next one crosses the link, so a decode message that arrives finds at
    most about one chunk ahead of it on the wire (ack clocking: no bandwidth estimate needed to pace).

With `decode_first=False` messages go in arrival order (the window still holds prefill chunks back; a decode
behind a held chunk waits for it, as it would behind bytes already in the socket).

The other sending side is each server's replies (the output hidden states of a prefill chunk travel back on the
same link, the other direction): their order is decided by the server (swarmlm/server), not here. Replies to a
session come back in the order of its steps; replies of different sessions interleave as the server finishes them.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator

from swarmlm.config import ClientConfig
from swarmlm.types import StepKind

_CLIENT = ClientConfig()  # the defaults below are the client's settings (config.py: each defined once, checked there)


@dataclass(frozen=True)
class TransmissionPolicy:
    decode_first: bool = _CLIENT.decode_first  # let decode messages pass waiting prefill chunks
    max_decode_burst: int = _CLIENT.max_decode_burst  # decode messages in a row that may pass a prefill chunk
    prefill_window: int | None = _CLIENT.prefill_window  # prefill messages written, not answered, per link (None: any)

    def __post_init__(self) -> None:  # (a pushing server builds one without a ClientConfig: checked here too)
        if self.max_decode_burst < 1:
            raise ValueError(f"max_decode_burst must be >= 1, got {self.max_decode_burst}")
        if self.prefill_window is not None and self.prefill_window < 1:
            raise ValueError(f"prefill_window must be >= 1 or None, got {self.prefill_window}")

    @classmethod
    def for_client(cls, config) -> "TransmissionPolicy":
        """From a ClientConfig. Without chunking a prefill is one message and nothing holds it back (the window paces
        chunks only), so chunking off + decode-first off is the plain arrival-order client."""
        chunking = config.prefill_chunk_tokens != 0
        return cls(decode_first=config.decode_first, max_decode_burst=config.max_decode_burst,
                   prefill_window=config.prefill_window if chunking else None)


@dataclass
class _Waiter:
    kind: StepKind
    seq: int  # arrival order
    granted: asyncio.Future


@dataclass
class LinkStats:
    written: dict[StepKind, int] = field(default_factory=lambda: {StepKind.DECODE: 0, StepKind.PREFILL: 0})
    overtakes: int = 0  # decode messages written while an earlier prefill message waited
    forced_prefill: int = 0  # prefill chunks written because the decode burst limit was reached


class LinkScheduler:
    """One per link, on the client's event loop (no locks: everything runs on that one thread).

    Use: `async with link.turn(kind): await call.write(msg)`, then `link.answered(kind)` when its reply arrives
    (or when the stream is abandoned with the message unanswered)."""

    def __init__(self, policy: TransmissionPolicy) -> None:
        self.policy = policy
        self._waiting: deque[_Waiter] = deque()
        self._seq = 0
        self._writing = False  # one write at a time: the order of writes is the order on the wire
        self.prefill_in_flight = 0  # written, reply not yet received
        self.in_flight = 0  # any kind
        self._burst = 0  # decode messages written in a row while a prefill chunk could have gone
        self.stats = LinkStats()

    @property
    def waiting(self) -> list[StepKind]:
        return [w.kind for w in self._waiting]

    # ---- the decision ------------------------------------------------------------------------------------
    def _prefill_allowed(self) -> bool:
        window = self.policy.prefill_window
        return window is None or self.prefill_in_flight < window

    def _pick(self) -> _Waiter | None:
        """The next message to write, or None (link busy, nothing waiting, or only held prefill chunks)."""
        if self._writing or not self._waiting:
            return None
        prefill_ok = self._prefill_allowed()
        if not self.policy.decode_first:
            head = self._waiting[0]
            return head if head.kind is StepKind.DECODE or prefill_ok else None
        decode = next((w for w in self._waiting if w.kind is StepKind.DECODE), None)
        prefill = next((w for w in self._waiting if w.kind is StepKind.PREFILL), None)
        if prefill is not None and prefill_ok and (decode is None or self._burst >= self.policy.max_decode_burst):
            return prefill
        return decode

    def _dispatch(self) -> None:
        # a cancelled caller's future is cancelled at once, its cleanup runs later: drop it from the queue now
        for w in [w for w in self._waiting if w.granted.done()]:
            self._waiting.remove(w)
        chosen = self._pick()
        if chosen is None:
            return
        self._waiting.remove(chosen)
        prefill_waiting = any(w.kind is StepKind.PREFILL for w in self._waiting)
        if chosen.kind is StepKind.DECODE:
            if prefill_waiting and self._prefill_allowed():
                self._burst += 1  # this decode passed a chunk that could have gone: counts against fairness
            elif not prefill_waiting:
                self._burst = 0
            if any(w.kind is StepKind.PREFILL and w.seq < chosen.seq for w in self._waiting):
                self.stats.overtakes += 1
        else:
            if self._burst >= self.policy.max_decode_burst and any(w.kind is StepKind.DECODE for w in self._waiting):
                self.stats.forced_prefill += 1
            self._burst = 0
            self.prefill_in_flight += 1
        self.in_flight += 1
        self._writing = True
        self.stats.written[chosen.kind] += 1
        chosen.granted.set_result(None)

    # ---- the caller's side ---------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def turn(self, kind: StepKind) -> AsyncIterator[None]:
        """Wait for this message's turn on the link; the body writes it. The next turn starts when it returns."""
        waiter = _Waiter(kind, self._seq, asyncio.get_running_loop().create_future())
        self._seq += 1
        self._waiting.append(waiter)
        self._dispatch()
        try:
            await waiter.granted
        except asyncio.CancelledError:
            if waiter in self._waiting:  # never granted: just leave the queue
                self._waiting.remove(waiter)
            elif waiter.granted.done() and not waiter.granted.cancelled():  # granted, cancelled before writing
                self._writing = False
                self.answered(kind)
            raise
        try:
            yield
        finally:
            self._writing = False
            self._dispatch()

    def free(self) -> bool:
        """Nothing is being written or waits for its turn: a message written now passes no one."""
        return not self._writing and not self._waiting

    def written_outside(self, kind: StepKind) -> None:
        """A message written without a turn (a decode step from the caller's thread, client/streams.py): counted in
        the stats, nothing else (it holds no place in the window)."""
        self.stats.written[kind] += 1

    def answered(self, kind: StepKind) -> None:
        """A written message got its reply (or never will): frees its place in the window."""
        self.in_flight = max(self.in_flight - 1, 0)
        if kind is StepKind.PREFILL:
            self.prefill_in_flight = max(self.prefill_in_flight - 1, 0)
        self._dispatch()


class Links:
    """One scheduler per server address, shared by every session of this client."""

    def __init__(self, policy: TransmissionPolicy) -> None:
        self.policy = policy
        self._links: dict[str, LinkScheduler] = {}

    def get(self, address: str) -> LinkScheduler:
        link = self._links.get(address)
        if link is None:  # (setdefault: the caller's thread may ask too, session.py's blocking decode step)
            link = self._links.setdefault(address, LinkScheduler(self.policy))
        return link

    def items(self) -> list[tuple[str, LinkScheduler]]:
        return list(self._links.items())
