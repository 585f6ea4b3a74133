"""An inference session through a chain of servers, with failover.

Per span of the route the session keeps what it has sent (hidden states and padding masks): when a server fails,
the broken span is re-routed (only that part of the chain), the history is replayed to the replacement so it
rebuilds its attention caches, and the step goes on. The answer is the same as if nothing had happened.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from swarmlm.client.remote import RemoteSequence
from swarmlm.client.transport import HopTiming, SpanStream
from swarmlm.errors import InvalidRequest, ServerFailed
from swarmlm.types import Route, Span

log = logging.getLogger(__name__)


@dataclass
class SpanSession:
    span: Span
    stream: SpanStream
    history: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # inputs sent, in order

    @property
    def position(self) -> int:
        return sum(h.shape[1] for h, _ in self.history)


@dataclass
class StepRecord:
    """One step through the whole chain: what each hop cost, and failovers."""

    tokens: int
    wall_s: float
    hops: list[HopTiming]
    failovers: int = 0
    failover_s: float = 0.0  # re-routing, reopening and replay


class InferenceSession:
    def __init__(self, remote: RemoteSequence, batch: int, max_length: int, l_in_hint: int = 16,
                 l_out_hint: int = 16) -> None:
        self.remote = remote
        self.batch = batch
        self.max_length = max_length
        self.l_in_hint = l_in_hint
        self.l_out_hint = l_out_hint
        self.spans: list[SpanSession] = []
        self.steps: list[StepRecord] = []
        self.route: Route | None = None
        self.open_s = 0.0  # routing + opening streams
        self.closed = False

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def open(self) -> "InferenceSession":
        """Route and open a stream on every span; a server that fails to open is banned and routed around."""
        t0 = time.perf_counter()
        attempts = 0
        while True:
            route = self.remote.route(0, self.remote.num_blocks, self.l_in_hint, self.l_out_hint, self.batch,
                                      self.max_length, refresh=attempts > 0)
            try:
                self.spans = self.remote.loop.run(self._open_spans(route.spans))
                break
            except ServerFailed as exc:
                attempts += 1
                if attempts > self.remote.config.max_retries:
                    raise
                log.warning("could not open a session: %s; routing around it", exc)
                self.remote.view.ban(exc.server_id)
        self.route = route
        self.open_s = time.perf_counter() - t0
        return self

    async def _open_spans(self, spans) -> list[SpanSession]:
        opened: list[SpanSession] = []
        try:
            for span in spans:
                stream = SpanStream(self.remote.channels, span, self.remote.config.step_timeout_s)
                await stream.open(self.batch, self.max_length)
                self.remote.view.local_sessions[span.server_id] = self.remote.view.local_sessions.get(span.server_id, 0) + 1
                opened.append(SpanSession(span, stream))
        except BaseException:
            await self._close_spans(opened)
            raise
        return opened

    async def _close_spans(self, spans: list[SpanSession]) -> None:
        for s in spans:
            await s.stream.close()
            left = self.remote.view.local_sessions.get(s.span.server_id, 1) - 1
            self.remote.view.local_sessions[s.span.server_id] = max(left, 0)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.remote.loop.run(self._close_spans(self.spans))

    def __enter__(self) -> "InferenceSession":
        return self.open() if not self.spans else self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def position(self) -> int:
        return self.spans[0].position if self.spans else 0

    # ---- steps -------------------------------------------------------------------------------------------
    def step(self, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [B, T, H] after the embeddings; mask: [B, T] of these tokens. Returns the last block's output."""
        if hidden.dim() != 3 or hidden.shape[0] != self.batch:
            raise InvalidRequest(f"expected hidden states [{self.batch}, T, H], got {list(hidden.shape)}")
        if self.position + hidden.shape[1] > self.max_length:
            raise InvalidRequest(f"session max_length {self.max_length} reached ({self.position} tokens held)")
        mask = torch.ones(hidden.shape[:2], dtype=torch.long) if mask is None else mask.to(torch.long)
        return self.remote.loop.run(self._step(hidden, mask))

    async def _step(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        record = StepRecord(tokens=hidden.shape[1], wall_s=0.0, hops=[])
        i = 0
        while i < len(self.spans):
            span = self.spans[i]
            try:
                out, timing = await span.stream.step(hidden, mask)
            except ServerFailed as exc:
                f0 = time.perf_counter()
                await self._failover(i, exc, record)
                record.failover_s += time.perf_counter() - f0
                continue  # retry this position of the chain with its replacement
            span.history.append((hidden, mask))
            record.hops.append(timing)
            hidden = out
            i += 1
        record.wall_s = time.perf_counter() - t0
        self.steps.append(record)
        return hidden

    async def _failover(self, i: int, exc: ServerFailed, record: StepRecord) -> None:
        """Replace span i by a new chain over the same blocks; bounded attempts, each failure banned."""
        broken = self.spans[i]
        await self._close_spans([broken])
        loop = self.remote.loop.loop
        while True:
            record.failovers += 1
            if record.failovers > self.remote.config.max_retries:
                raise exc
            self.remote.view.ban(exc.server_id)
            log.warning("failover: %s; re-routing blocks [%d, %d)", exc, broken.span.start, broken.span.end)
            # route the broken part again from a fresh view of the swarm (blocking DHT reads go to a thread)
            route = await loop.run_in_executor(None, self._reroute, broken.span)
            try:
                replacement = await self._open_spans(route.spans)
            except ServerFailed as again:
                exc = again
                continue
            try:
                await self._replay(broken.history, replacement)
            except ServerFailed as again:
                await self._close_spans(replacement)
                exc = again
                continue
            self.spans[i:i + 1] = replacement
            return

    def _reroute(self, span: Span) -> Route:
        return self.remote.route(span.start, span.end, self.l_in_hint, self.l_out_hint, self.batch,
                                 self.max_length, refresh=True)

    async def _replay(self, history: list[tuple[torch.Tensor, torch.Tensor]], spans: list[SpanSession]) -> None:
        """Send the broken span's past inputs through its replacement chain so their caches match."""
        if not history:
            return
        hidden = torch.cat([h for h, _ in history], dim=1)
        mask = torch.cat([m for _, m in history], dim=1)
        for span in spans:
            out, _ = await span.stream.step(hidden, mask)
            span.history.append((hidden, mask))
            hidden = out

    def describe(self) -> str:
        return " -> ".join(f"{s.span.server_id[:12]}[{s.span.start}:{s.span.end})" for s in self.spans)

    def route_spans(self) -> list[Span]:
        return [s.span for s in self.spans]
