"""An inference session through a chain of servers, with failover and pipelined chunked prefill.

One step engine (`_attempt`): a step's tokens are split into chunks (chunking.py: one chunk for a decode step or a
short prompt). Every span has a sender and a receiver: the sender writes chunk k as soon as the previous span has
answered it, the receiver reads the answers in order and hands them on, so chunk k is on server 2 while chunk k+1
is still on server 1. With several chunks (or push) they run as two tasks per span; a step of one chunk that is not
pushed (every decode step) runs the same sender and receiver hop after hop in the step's own task, which saves
the tasks and their wake-ups (benchmarks/hop_breakdown.py).

One timeout policy. A server that is alive but does not answer (hung) is detected per reply: no reply within its
hang timeout (its announced compute time for the step, times `hang_factor`, plus `hang_floor_s`, at most
`step_timeout_s`) is a failure of that server, named, banned and failed over exactly as a crash. Behind it, a
watchdog catches a step that makes no progress at all for longer than any reply may take (`watchdog_s`: a wait
that no server is to blame for, e.g. a lost wake-up): its unfinished spans are reopened and replayed.

Per span of the route the session keeps what it has sent and got answered (hidden states and padding masks): when
a server fails, the broken span is re-routed (only that part of the chain), the history is replayed to the
replacement so it rebuilds its attention caches, and the step goes on from the chunks each span has answered. A
healthy span left with chunks written but not answered (its cache state unknown to us) is reopened and replayed
the same way. The answer is the same as if nothing had happened.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

import torch

from swarmlm.client.chunking import ChunkRule, chunk_tokens_for_hop, split
from swarmlm.client.remote import RemoteSequence
from swarmlm.client.streams import HopTiming, SpanStream
from swarmlm.config import ClientConfig
from swarmlm.errors import InvalidRequest, ServerFailed, ServerHung
from swarmlm.swarm.records import ServerRecord
from swarmlm.types import Route, Span
from swarmlm.wire import compress
from swarmlm.wire import swarm_pb2 as pb

log = logging.getLogger(__name__)


@dataclass
class SpanSession:
    span: Span
    stream: SpanStream
    admission: str = ""  # this session's entry in the client's router (its load on the server), until closed
    history: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # inputs sent, in order

    @property
    def position(self) -> int:
        return sum(h.shape[1] for h, _ in self.history)


class _Progress:
    """Wake every waiter when the pipeline moves. An Event per generation rather than asyncio.Condition, whose
    wait() re-acquires its lock on cancellation and, on Python 3.11, can leave a cancelled pipeline hanging.
    `stop()` ends every wait: a task that missed its cancellation (a race in some awaitables) stops at its next
    wait instead of waiting forever for a pipeline that is gone."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self.stopped = False
        self.generation = 0  # notifications so far: the pipeline's progress, for the stall watchdog

    def notify(self) -> None:
        self.generation += 1
        self._event.set()
        self._event = asyncio.Event()

    def stop(self) -> None:
        self.stopped = True
        self.notify()

    async def wait_for(self, predicate) -> None:
        while True:  # no await between the checks and the wait: no wake-up is missed
            if self.stopped:
                raise asyncio.CancelledError("the pipeline stopped")
            if predicate():
                return
            await self._event.wait()


@dataclass
class StepRecord:
    """One step through the whole chain: what each hop cost, and failovers."""

    tokens: int
    wall_s: float
    hops: list[HopTiming]
    failovers: int = 0
    failover_s: float = 0.0  # re-routing, reopening and replay
    chunks: int = 1  # messages the step's tokens were split into
    reopened: int = 0  # healthy spans reopened because a failure elsewhere left them mid-step
    stalls: int = 0  # times the whole step made no progress for watchdog_s (then every unfinished hop reopens)
    hung: list[str] = field(default_factory=list)  # servers that did not answer within their hang timeout (banned)
    pushed: bool = False  # server-to-server push on this step's route (ClientConfig.push, PerfModel.push_pays)


@dataclass
class _Hop:
    """One span's part of one step: chunks written to it, and its outputs in order (None: answered in a replay)."""

    span: SpanSession
    outputs: list[torch.Tensor | None] = field(default_factory=list)
    written: int = 0  # chunks written (or awaited from a push by the previous server) whose reply may be read
    base_id: int = 0  # the step id chunk 0 takes on this hop's stream (chunk k: base_id + k)

    def __post_init__(self) -> None:
        self.base_id = self.span.stream.next_step_id - self.written

    @property
    def answered(self) -> int:
        return len(self.outputs)

    @property
    def claimed(self) -> int:
        """Chunks that have a step id on this hop's stream: being written, written, or awaited from a push."""
        return self.span.stream.next_step_id - self.base_id


def hang_timeout_s(config: ClientConfig, record: ServerRecord | None, span: Span, rows: int, tokens: int) -> float:
    """How long a reply of this span's server may take before the server counts as hung: its announced compute time
    for `tokens` new tokens of `rows` sequences over the span's blocks, times hang_factor, plus hang_floor_s (load,
    scheduling and the wire), at most step_timeout_s. A server that announces nothing gets the floor."""
    compute = 0.0
    if record is not None:
        per_block = record.decode_s * rows if tokens == 1 else record.prefill_a_s * rows * tokens + record.prefill_b_s
        compute = per_block * span.length
    return min(config.step_timeout_s, config.hang_floor_s + config.hang_factor * compute)


def watchdog_s(config: ClientConfig) -> float:
    """No progress at all for this long stalls a step. Longer than any reply's own bound (step_timeout_s), so a
    hung server is always caught first by its reply's timeout, and named."""
    return config.step_timeout_s + config.hang_floor_s


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
        cfg = self.remote.config
        opened: list[SpanSession] = []
        try:
            for span in spans:
                # an open computes nothing: a server that does not answer it within the hang floor is hung
                stream = SpanStream(self.remote.channels, span, min(cfg.step_timeout_s, cfg.hang_floor_s))
                await stream.open(self.batch, self.max_length)
                admission = self.remote.router.admit([span], self.l_in_hint, self.l_out_hint)
                opened.append(SpanSession(span, stream, admission))
        except BaseException:
            await self._close_spans(opened)
            raise
        return opened

    async def _close_spans(self, spans: list[SpanSession]) -> None:
        for s in spans:
            await s.stream.close()
            self.remote.router.release(s.admission)

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

    def chunk_tokens(self, hidden: torch.Tensor) -> int:
        """Tokens per message for this step (see chunking.py): fixed, off (0), or the largest of the hops' sizes."""
        cfg = self.remote.config
        tokens = hidden.shape[1]
        if tokens == 1 or cfg.prefill_chunk_tokens == 0:
            return tokens
        if cfg.prefill_chunk_tokens is not None:
            return min(cfg.prefill_chunk_tokens, tokens)
        rule = ChunkRule(min_tokens=cfg.chunk_min_tokens, max_tokens=cfg.chunk_max_tokens)
        sizes = []
        for s in self.spans:
            # in the format this link's messages go in (wire/compress.py), not the client's dtype
            wire = self.remote.channels.wire_dtype_for(s.span.address, 4 * hidden.numel())
            bytes_per_token = math.ceil(hidden.shape[0] * hidden.shape[2] * compress.bytes_per_value(wire))
            est = self.remote.channels.bandwidth(s.span.address)
            if est.rtt_s is None and s.span.server_id in self.remote.view.rtt_s:
                est.rtt_s = self.remote.view.rtt_s[s.span.server_id]  # base cost, until a decode step measures it
            record = self.remote.view.records.get(s.span.server_id)
            a = record.prefill_a_s * s.span.length * hidden.shape[0] if record else 0.0
            b = record.prefill_b_s * s.span.length if record else 0.0
            sizes.append(chunk_tokens_for_hop(rule, bytes_per_token, est.bandwidth_bps, a, b))
        return min(max(sizes), tokens)

    async def _step(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        chunks = split(hidden, mask, self.chunk_tokens(hidden))
        record = StepRecord(tokens=hidden.shape[1], wall_s=0.0, hops=[], chunks=len(chunks))
        hops = [_Hop(s) for s in self.spans]
        while True:
            broken = await self._attempt(hops, chunks, record)
            if not broken:
                break
            f0 = time.perf_counter()
            for i in sorted(broken, reverse=True):  # from the end, so earlier indices stay valid
                hops[i:i + 1] = await self._replace(hops[i], broken[i], record)
                self.spans = [h.span for h in hops]
            record.failover_s += time.perf_counter() - f0
        assert all(h.answered == len(chunks) for h in hops)
        record.wall_s = time.perf_counter() - t0
        self.steps.append(record)
        return hops[-1].outputs[0] if len(chunks) == 1 else torch.cat(hops[-1].outputs, dim=1)

    def _hang_timeout_s(self, span: Span, rows: int, tokens: int) -> float:
        return hang_timeout_s(self.remote.config, self.remote.view.records.get(span.server_id), span, rows, tokens)

    async def _attempt(self, hops: list[_Hop], chunks: list[tuple[torch.Tensor, torch.Tensor]],
                       record: StepRecord) -> dict[int, ServerFailed | None]:
        """Push every chunk through every hop. Returns the hops to replace: failed (their error, a hung server's
        included) or left with unanswered chunks by a failure elsewhere (None); empty when the step is complete."""
        push = self.remote.push([h.span.span for h in hops])
        record.pushed = push
        progress = _Progress()  # notified whenever a hop writes or answers a chunk

        def source(i: int, k: int) -> torch.Tensor:
            return chunks[k][0] if i == 0 else hops[i - 1].outputs[k]

        def push_chain(i: int, k: int) -> list[pb.PushTarget]:
            """Server-to-server push (server/push.py): the hops after hop i that have nothing of chunk k yet await
            it from the previous server (they take its next step id now, so their replies can be read as soon as
            they come); the server of hop i is told to push on to them."""
            targets: list[pb.PushTarget] = []
            for h in hops[i + 1:] if push else ():
                if h.claimed != k:  # a chunk of it is still to be sent by us: the push chain stops here
                    break
                h.span.stream.expect(chunks[k][0].shape[1])
                h.written = k + 1
                targets.append(pb.PushTarget(address=h.span.span.address, session_id=h.span.stream.session_id,
                                             step_id=h.base_id + k, secret=h.span.stream.session_secret))
            return targets

        async def send(i: int) -> None:
            hop = hops[i]
            while hop.written < len(chunks):
                k = hop.written
                if i > 0:  # its input is the previous hop's output, unless that server pushes it here
                    await progress.wait_for(lambda: hops[i - 1].answered > k or hop.claimed > k)
                if hop.claimed > k:  # awaited from a push (push_chain advanced written with it)
                    hop.written = max(hop.written, k + 1)
                    continue
                targets = push_chain(i, k)
                await hop.span.stream.send(source(i, k), chunks[k][1], targets)
                hop.written = max(hop.written, k + 1)
                progress.notify()

        async def receive(i: int) -> None:
            hop = hops[i]
            while hop.answered < len(chunks):
                k = hop.answered
                # its input (the previous hop's output) is recorded with its output, so that reply is read first
                # (pushed, the next server may answer before the client has read it: its reply waits in the stream)
                await progress.wait_for(lambda: hop.written > k and (i == 0 or hops[i - 1].answered > k))
                x = chunks[k][0]
                timeout = self._hang_timeout_s(hop.span.span, x.shape[0], x.shape[1])
                out, timing = await hop.span.stream.receive(timeout)
                hop.span.history.append((source(i, k), chunks[k][1]))
                hop.outputs.append(out)
                record.hops.append(timing)
                progress.notify()

        failed: dict[int, BaseException] = {}
        if len(chunks) == 1 and not push:
            # one message per hop: the same sender and receiver, hop after hop in this task (no tasks to wake).
            # The watchdog's rule per hop: no progress for watchdog_s
            for i in range(len(hops)):
                try:
                    async with asyncio.timeout(watchdog_s(self.remote.config)):
                        await send(i)
                        await receive(i)
                except TimeoutError:
                    return self._stalled(hops, 1, record)
                except ServerFailed as exc:
                    failed[i] = exc  # hops before it answered, hops after it have nothing written
                    break
        else:
            tasks = {asyncio.ensure_future(f(i)): i for i in range(len(hops)) for f in (send, receive)}
            stalled = False
            try:
                stalled = await self._watch(tasks, progress)
            finally:
                progress.stop()
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            if stalled:
                return self._stalled(hops, len(chunks), record)
            for t, i in tasks.items():
                exc = None if t.cancelled() else t.exception()
                if exc is not None:
                    failed.setdefault(i, exc)
        broken: dict[int, ServerFailed | None] = {}
        for i, exc in failed.items():
            if not isinstance(exc, ServerFailed):
                raise exc
            broken[i] = exc
            if isinstance(exc, ServerHung):
                record.hung.append(exc.server_id)
        for i, hop in enumerate(hops):
            if i not in broken and hop.span.stream.unanswered:  # written, not answered: cache state unknown
                broken[i] = None
        return broken

    def _stalled(self, hops: list[_Hop], n_chunks: int, record: StepRecord) -> dict[int, ServerFailed | None]:
        """Nothing moved for a whole step timeout: every hop not done is reopened and replayed."""
        record.stalls += 1
        log.warning("step stalled for %.0f s; hops (written, answered, unanswered, link in flight): %s",
                    watchdog_s(self.remote.config),
                    [(h.written, h.answered, h.span.stream.unanswered, h.span.stream.link.in_flight) for h in hops])
        if record.stalls > self.remote.config.max_retries:
            stuck = next(h for h in hops if h.answered < n_chunks)
            raise ServerFailed(stuck.span.span.server_id, "the step stalled there on every attempt")
        return {i: None for i, h in enumerate(hops) if h.answered < n_chunks}

    async def _watch(self, tasks: dict, progress: _Progress) -> bool:
        """Wait until every task is done or one fails; True if the pipeline made no progress for a whole step
        timeout. Every reply is bounded on its own (the hang timeout); this bounds the whole, whatever was missed."""
        seen = progress.generation
        while True:
            done, _ = await asyncio.wait(tasks, timeout=watchdog_s(self.remote.config),
                                         return_when=asyncio.FIRST_EXCEPTION)
            if len(done) == len(tasks) or any(t.exception() for t in done if not t.cancelled()):
                return False
            if progress.generation == seen:
                return True
            seen = progress.generation

    async def _replace(self, hop: _Hop, exc: ServerFailed | None, record: StepRecord) -> list[_Hop]:
        """A new chain over the hop's blocks, its caches rebuilt from the span's history; bounded attempts, each
        failed server banned. The new hops carry on from the chunks the old one answered."""
        broken = hop.span
        await self._close_spans([broken])
        loop = self.remote.loop.loop
        while True:
            if exc is None:
                record.reopened += 1
                log.info("reopening blocks [%d, %d) left mid-step", broken.span.start, broken.span.end)
            else:
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
            done = hop.answered
            hops = [_Hop(s, [None] * done, written=done) for s in replacement]
            hops[-1].outputs = list(hop.outputs)  # the chain's answers so far are the broken span's
            return hops

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
            out, _ = await span.stream.step(hidden, mask, self._hang_timeout_s(span.span, *hidden.shape[:2]))
            span.history.append((hidden, mask))
            hidden = out

    def route_spans(self) -> list[Span]:
        return [s.span for s in self.spans]
