"""The client's step engine: one attempt at carrying a step's chunks through every span of the route.

A step's tokens are split into chunks (chunking.py: one chunk for a decode step or a short prompt). Every hop has a
sender and a receiver: the sender writes chunk k as soon as the previous hop has answered it, the receiver reads
the answers in order and hands them on, so chunk k is on server 2 while chunk k+1 is still on server 1. With
several chunks (or push) they run as two tasks per hop (`pipelined`); a step of one chunk that is not pushed (every
decode step) runs the same sender and receiver hop after hop in the caller's task (`hop_by_hop`), which saves the
tasks and their wake-ups (benchmarks/hop_breakdown.py). On framed streams (client/frame_call.py) such a step runs
from the caller's own thread (`run_blocking`): no hand-off to the client's loop thread and back; a plain relayed
decode step's hops there in one C call (`_run_relayed`, client/relay.py), the Python hops taking over where it stops.

Timers. A server that is alive but does not answer (hung) is detected per reply: no reply within its hang timeout
(`hang_timeout_s`) is a failure of that server, named as any other. Behind it, a watchdog catches an attempt that
makes no progress at all for longer than any reply may take (`watchdog_s`: a wait that no server is to blame for,
e.g. a lost wake-up): the attempt ends `stalled`.

An attempt never repairs anything: it returns an `AttemptOutcome` (complete, or which hops failed and which were
left mid-step) and the session (session.py) re-routes, reopens and replays, then runs the next attempt.
"""
from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from typing import Callable

import grpc
import torch

from swarmlm.client import relay
from swarmlm.client.frame_call import FrameCall, rpc_error
from swarmlm.client.streams import HopTiming, SpanStream, Undecoded, relayed_timing, server_failure
from swarmlm.config import ClientConfig
from swarmlm.errors import PushRefused, ServerFailed, ServerHung
from swarmlm.perf.model import ComputeProfile
from swarmlm.types import CacheOp, Span
from swarmlm.wire import session_keys
from swarmlm.wire import swarm_pb2 as pb

Chunk = tuple[torch.Tensor, torch.Tensor]  # hidden [B, T, H], padding mask [B, T]


def hang_timeout_s(config: ClientConfig, profile: ComputeProfile | None, span: Span, rows: int, n_tokens: int,
                   cached: bool) -> float:
    """How long a reply of this span's server may take before the server counts as hung: its announced compute time
    for `tokens` new tokens of `rows` sequences over the span's blocks, from scratch or past what its cache holds
    (`cached`; perf: `ComputeProfile.step_s`), times hang_factor, plus hang_floor_s (load, scheduling and the wire),
    at most step_timeout_s. A server that announces nothing gets the floor."""
    compute = profile.step_s(span.length, rows, n_tokens, cached) if profile is not None else 0.0
    return min(config.step_timeout_s, config.hang_floor_s + config.hang_factor * compute)


def watchdog_s(config: ClientConfig) -> float:
    """No progress at all for this long stalls a step. Longer than any reply's own bound (step_timeout_s), so a
    hung server is always caught first by its reply's timeout, and named."""
    return config.step_timeout_s + config.hang_floor_s


MAX_SEALED_PUSH_KEYS = 16  # next sessions whose sealed push key a span keeps (a failover opens new ones)


@dataclass
class OpenSpan:
    """A span of the route with its open stream: what the session keeps per span from step to step."""

    span: Span
    stream: SpanStream
    admission: str = ""  # this session's entry in the client's router (its load on the server), until closed
    # inputs sent and answered, in order (for a replay); a relayed input may be kept as its server sent it
    # (`Undecoded`, made a tensor only when `history` is read: a failover or a cache op, not a decode step)
    _history: list[tuple[torch.Tensor | Undecoded, torch.Tensor]] = field(default_factory=list)
    # tokens the server held from a cached prefix before the history (never sent: a replay recomputes their
    # inputs), and the prefix's row behind each row the server holds (cache ops may copy it)
    prefix_tokens: int = 0
    prefix_rows: tuple[int, ...] = (0,)
    _history_tokens: int = 0  # tokens of `history` (kept, not summed each step: a decode step reads it)
    _sealed_push_keys: dict[str, bytes] = field(default_factory=dict)  # next session id -> its push key sealed

    @property
    def position(self) -> int:
        return self.prefix_tokens + self._history_tokens

    def sealed_push_key(self, target: SpanStream) -> bytes:
        """`target`'s push key sealed for this span's server (wire/session_keys.py): sealed once per target
        session and kept, the same bytes step after step, so that server opens it once (Session.push_key)."""
        sealed = self._sealed_push_keys.get(target.session_id)
        if sealed is None:
            if len(self._sealed_push_keys) >= MAX_SEALED_PUSH_KEYS:  # (next sessions reopened by failovers)
                self._sealed_push_keys.clear()
            sealed = self._sealed_push_keys[target.session_id] = session_keys.seal_push_key(
                self.stream.keys.seal, target.session_id, target.keys.push)
        return sealed

    @property
    def history(self) -> list[Chunk]:
        """The inputs sent and answered, as tensors."""
        for n, (hidden, mask) in enumerate(self._history):
            if isinstance(hidden, Undecoded):
                self._history[n] = (hidden.tensor(), mask)
        return self._history

    @history.setter
    def history(self, chunks: list[Chunk]) -> None:
        self._history = chunks

    @property
    def cached(self) -> bool:
        """Its server holds tokens of this session's steps (a step's bound is then past a cache)."""
        return bool(self._history)

    def answered(self, hidden: torch.Tensor | Undecoded, mask: torch.Tensor, n_tokens: int | None = None) -> None:
        """A chunk sent and answered joins the history (`n_tokens`: its tokens, hidden.shape[1], where the caller
        knows them: no torch call right after the wait)."""
        self._history.append((hidden, mask))
        self._history_tokens += hidden.shape[1] if n_tokens is None else n_tokens

    @property
    def rows(self) -> int:
        """Sequences its server holds (0 while it holds no token)."""
        if self._history:
            return int(self._history[0][0].shape[0])
        return len(self.prefix_rows) if self.prefix_tokens else 0

    def edit(self, op: CacheOp) -> None:
        """The history follows a cache op as the server's cache does, so a replay rebuilds the edited cache."""
        keep = op.kept(self.position)
        if self.prefix_tokens:
            if op.rows is not None:
                self.prefix_rows = tuple(self.prefix_rows[r] for r in op.rows)
            self.prefix_tokens = min(self.prefix_tokens, keep)
            truncate = keep - self.prefix_tokens if op.truncate_to is not None else None
            op = CacheOp(truncate, op.rows) if truncate is not None or op.rows is not None else None
            if op is None:
                return
        self.history = edited_history(self.history, op)
        self._history_tokens = sum(h.shape[1] for h, _ in self.history)


def edited_history(history: list[Chunk], op: CacheOp) -> list[Chunk]:
    """The inputs a cache op keeps: their first op.truncate_to tokens, rows op.rows (new row i = old row rows[i])."""
    keep = op.kept(sum(h.shape[1] for h, _ in history))
    rows = torch.tensor(op.rows, dtype=torch.long) if op.rows is not None else None
    edited, held = [], 0
    for hidden, mask in history:
        if held >= keep:
            break
        take = min(hidden.shape[1], keep - held)
        hidden, mask = hidden[:, :take], mask[:, :take]
        edited.append((hidden, mask) if rows is None else (hidden[rows], mask[rows]))
        held += take
    return edited


@dataclass
class Hop:
    """One open span's part of one step: chunks written to it, and its outputs in order (None: answered in a replay
    to a replacement server)."""

    open_span: OpenSpan
    outputs: list[torch.Tensor | None] = field(default_factory=list)
    written: int = 0  # chunks written (or awaited from a push by the previous server) whose reply may be read
    base_id: int = 0  # the step id chunk 0 takes on this hop's stream (chunk k: base_id + k)
    op: CacheOp | None = None  # the step's cache edit, sent with chunk 0 (a replacement's replay holds it already)
    # its open span's (fixed for the hop: a failover makes new hops), kept as attributes: read several times a hop
    span: Span = field(init=False, repr=False)
    stream: SpanStream = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.span, self.stream = self.open_span.span, self.open_span.stream
        self.base_id = self.stream.next_step_id - self.written

    @property
    def answered(self) -> int:
        return len(self.outputs)

    @property
    def claimed(self) -> int:
        """Chunks that have a step id on this hop's stream: being written, written, or awaited from a push."""
        return self.stream.next_step_id - self.base_id


@dataclass
class AttemptOutcome:
    """What one attempt did: replies read, and the hops the session must replace before the next attempt."""

    timings: list[HopTiming]  # one per reply read, in the order read
    failed: dict[int, ServerFailed]  # hop index -> its server's failure (a hung server's included)
    unsettled: list[int]  # healthy hops left mid-step (their cache state unknown to us): reopen and replay
    stalled: bool = False  # no progress for watchdog_s: every hop not done is in `unsettled`, none in `failed`
    push_refused: bool = False  # a server refused to push on: it and the hops after it are in `unsettled`

    @property
    def complete(self) -> bool:
        return not self.failed and not self.unsettled

    def to_replace(self) -> dict[int, ServerFailed | None]:
        """Hop index -> why it is replaced: its server's failure, or None (left mid-step, reopened)."""
        return {**{i: None for i in self.unsettled}, **self.failed}


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


class StepPipeline:
    """One attempt at a step: every chunk through every hop, from where each hop left off (`Hop.written`,
    `Hop.outputs`). `hang_timeout(span, rows, tokens, cached)` bounds each reply (`hang_timeout_s`); `push`: servers push
    each output on to the next hop (the session's choice for this route, RemoteSequence.push)."""

    def __init__(self, hops: list[Hop], chunks: list[Chunk], config: ClientConfig,
                 hang_timeout: Callable[[Span, int, int, bool], float], push: bool = False,
                 padded: bool = True, relay_chain: relay.RelayChain | None = None) -> None:
        self.hops = hops
        self.chunks = chunks
        self.push = push
        self.keep_routes = push and config.keep_routes  # (the servers keep a pushed route: SpanStream._request)
        # False: no chunk's mask has padding (the session knows it already): none is looked at again, none is sent
        self.padded = padded
        self.relay = relay_chain  # the route's C chain (run_blocking takes it for a plain relayed decode step)
        self.watchdog_s = watchdog_s(config)
        self.hang_timeout = hang_timeout
        self._progress: _Progress | None = None  # (made by the event loop's attempt only: run_blocking needs none)
        self.timings: list[HopTiming] = []
        self.chained = False  # run_blocking's hops all went through the C chain (a relay lane may take the next)

    @property
    def progress(self) -> _Progress:
        """Notified whenever a hop writes or answers a chunk (the tasks of `run` wait on it)."""
        if self._progress is None:
            self._progress = _Progress()
        return self._progress

    def _wire_mask(self, k: int) -> torch.Tensor | None:
        """Chunk k's mask for its message (None: no padding, no mask on the wire)."""
        return self.chunks[k][1] if self.padded else None

    async def run(self) -> AttemptOutcome:
        """Raises what is not a server's failure (e.g. InvalidRequest); a server's failure, or its refusal to push
        on (PushRefused: nothing computed there), is in the outcome."""
        if len(self.chunks) == 1 and not self.push:
            failed, stalled = await self._hop_by_hop()
        else:
            failed, stalled = await self._pipelined()
        return self._outcome(failed, stalled)

    def _outcome(self, failed: dict[int, BaseException], stalled: bool = False) -> AttemptOutcome:
        """The attempt's outcome from its hops' failures (raises one that is not a server's failure)."""
        if stalled:
            unsettled = [i for i, h in enumerate(self.hops) if h.answered < len(self.chunks)]
            return AttemptOutcome(self.timings, {}, unsettled, stalled=True)
        refused = [i for i, exc in failed.items() if isinstance(exc, PushRefused)]
        for exc in failed.values():
            if not isinstance(exc, (ServerFailed, PushRefused)):
                raise exc
        failed = {i: exc for i, exc in failed.items() if isinstance(exc, ServerFailed)}
        # written, not answered: the cache state of a healthy hop's server is unknown. After a refused push, the
        # hops after the refusing one await pushed step ids that never come: they are reopened too
        unsettled = [i for i, h in enumerate(self.hops)
                     if i not in failed and (h.stream.unanswered or refused and i >= min(refused))]
        return AttemptOutcome(self.timings, failed, unsettled, push_refused=bool(refused))

    @property
    def blocking_ok(self) -> bool:
        """One chunk, nothing of it written yet, every hop on a framed stream: `run_blocking` can."""
        return len(self.chunks) == 1 and all(h.written == 0 and h.stream.blocking_ok for h in self.hops)

    def run_blocking(self, relayed: tuple | None = None) -> AttemptOutcome:
        """The attempt from the caller's thread (`blocking_ok` only), no event loop involved: each hop's step written
        and its reply awaited on the socket itself (SpanStream.send_blocking, receive_blocking), each reply bounded
        by its hang timeout as in `_receive`. Pushed, the first hop's step is written with the rest of the route
        and the caller sleeps until the last hop's reply (the middle ones are read after it: one wake-up a step).
        Raises what is not a server's failure, as `run`. `relayed`: what `self.relay` did of this step already
        (RelayLane.step stopped short: RelayChain.run's result), taken and gone on from here."""
        x, mask = self.chunks[0]
        wire_mask = mask if self.padded else None  # (`_wire_mask`: chunk 0's)
        hops, n = self.hops, len(self.hops)
        bounds = [self.hang_timeout(h.span, x.shape[0], x.shape[1], h.open_span.cached) for h in hops]
        i = 0
        if relayed is not None or self.relay is not None and self._relayable(x):
            i, failed = self._run_relayed(x, mask, bounds, relayed)
            if failed is not None:
                return failed
        while i < n:
            hop = hops[i]
            # its input: the chunk, or the previous reply (relayed: kept `Undecoded`, its bytes go on as they came
            # when the link takes float32; `_request` encodes its tensor for another wire format)
            source = x if i == 0 else hops[i - 1].outputs[0]
            try:
                # the hops it pushes on to await their step (`written`)
                targets = self._push_targets(i, 0) if self.push else ()
                hop.stream.send_blocking(source, wire_mask, bounds[i], targets, hop.op, self.keep_routes)
            except (ServerFailed, PushRefused) as exc:
                self._decode_outputs()
                return self._outcome({i: exc})
            hop.written = 1
            end = i + 1 + len(targets)
            if targets:
                FrameCall.wait_last([h.stream.call for h in hops[i:end]], sum(bounds[i:end]))
            i, failed = self._read_replies(i, end, source, mask, bounds)
            if failed is not None:
                self._decode_outputs()
                return self._outcome({i: failed})
        return AttemptOutcome(self.timings, {}, [])

    def _read_replies(self, i: int, end: int, source: torch.Tensor | Undecoded, mask: torch.Tensor,
                      bounds: list[float]) -> tuple[int, ServerFailed | PushRefused | None]:
        """Hops i..end-1's replies read in order, each within its bound (`source`: hop i's input; pushed, each next
        hop's is the previous one's output). Returns `end` and None, or the hop that failed and its failure."""
        n = len(self.hops)
        for j in range(i, end):
            # a middle hop's float32 reply is checked but not made a tensor: relayed, only its bytes go on; pushed,
            # the next server has it already (the history keeps it as it came: a failover's replay makes it one)
            answering = self.hops[j]
            try:
                out, timing = answering.stream.receive_blocking(bounds[j], keep_undecoded=j + 1 < n)
            except (ServerFailed, PushRefused) as exc:
                return j, exc
            answering.open_span.answered(source, mask)  # (its input joins the history with its output)
            answering.outputs.append(out)
            self.timings.append(timing)
            source = out  # (the next pushed hop's input)
        return end, None

    # ---- the C chain (client/relay.py) ----------------------------------------------------------------------
    def _relayable(self, x: torch.Tensor) -> bool:
        """May this step's hops run in the C chain? A plain decode step: no padding, no cache op, float32 x [B, 1, H]
        in C order, every hop's reply a compact ANSWER on a framed keyed stream with nothing read ahead (its
        FrameCall's buffer empty: the chain reads the socket itself), and either relayed: every hop a compact STEP
        (float32 on its link) whose server keeps no route (a STEP would be pushed on: the Python path's REQUEST
        drops it first); or pushed on a kept route: hop 0's step a STEP on the route its server keeps
        (`SpanStream.on_kept_route`, what `_request` asks), the others awaited from their pushes."""
        if self.padded or x.dtype is not torch.float32 or x.shape[1] != 1 or not x.is_contiguous():
            return False
        if self.push and not (self.keep_routes and len(self.hops) <= relay.MAX_PUSHED):
            return False
        nbytes = 4 * x.numel()
        shape = x.shape
        for hop in self.hops:
            stream = hop.stream
            if hop.op is not None or not stream._compact(shape) or stream.call._buf:
                return False
            if self.push:  # (the link's format and a kept route matter for hop 0's STEP only: below)
                continue
            if stream.keeps_route or stream.channels.wire_dtype_for(hop.span.address, nbytes) != "float32":
                return False
        if self.push:
            first = self.hops[0]
            return first.stream.channels.wire_dtype_for(first.span.address, nbytes) == "float32" and \
                first.stream.on_kept_route(self._kept_route())
        return True  # (the chain is these streams': the session gives one only if it `fits`)

    def _kept_route(self) -> tuple[tuple[str, int], ...]:
        """The route a pushed step names from hop 0 (each later hop's session and the step id it awaits next: what
        `_push_targets` puts in its targets when nothing of the step is written yet)."""
        return tuple((hop.stream.session_id, hop.stream.next_step_id) for hop in self.hops[1:])

    def _run_relayed(self, x: torch.Tensor, mask: torch.Tensor, bounds: list[float],
                     relayed: tuple | None = None) -> tuple[int, AttemptOutcome | None]:
        """The hops in the C chain (`relayed`: its result, if it ran already), relayed or pushed (`self.push`: on the
        kept route, `_relayable`), recorded as `run_blocking` records them (history, outputs, timings; pushed, hop
        0's STEP and the route it went on as `_request` records them, the other hops' steps awaited as
        `_push_targets` records them). Where it stopped short, that hop's reply is read here as `run_blocking` reads
        it (its failure the attempt's outcome, or raised), and pushed, the rest of the route's replies after it.
        Returns the first hop still to run (n: none), or the attempt's outcome if one failed."""
        pushed = self.push
        done, outs, stopped = relayed if relayed is not None else self.relay.run(x, bounds, pushed)
        if pushed:
            self.hops[0].stream.went_on_route()  # (its STEP was built: `_request` records the route there)
        # (each read whole once, as lists: a slice of a list is no call, a slice of a ctypes array is one)
        ints, times = self.relay.ints[:relay.INTS * done], self.relay.times[:relay.TIMES * done]
        answered = relay.take_answered([h.open_span for h in self.hops], x, mask, outs, ints, times, 4 * x.numel(),
                                       x.shape[1], pushed)
        self.timings += map(relayed_timing, answered)
        for j in range(done):
            hop = self.hops[j]
            hop.written = 1
            hop.outputs.append(outs[j])
        if stopped is None:
            self.chained = True
            return done, None
        for hop in self.hops[max(done, 1):] if pushed else ():  # (awaited from the pushes: `_push_targets`)
            hop.stream.expect(x.shape)
            hop.written = 1
        n = len(self.hops)
        hop = self.hops[done]
        source = outs[done - 1] if done else x
        try:
            out, timing = self._resume(hop, stopped, x, bounds[done], keep_undecoded=done + 1 < n,
                                       written=done == 0 or not pushed)
        except (ServerFailed, PushRefused) as exc:
            return done, self._outcome({done: exc})
        hop.open_span.answered(source, mask)
        hop.outputs.append(out)
        self.timings.append(timing)
        if not pushed:
            return done + 1, None
        i, failed = self._read_replies(done + 1, n, out, mask, bounds)  # (the rest of the route's, as `run_blocking`)
        if failed is not None:
            self._decode_outputs()
            return i, self._outcome({i: failed})
        return n, None

    @staticmethod
    def _resume(hop: Hop, stopped: relay.Stopped, x: torch.Tensor, bound_s: float, keep_undecoded: bool,
                written: bool = True) -> tuple[torch.Tensor | Undecoded, HopTiming]:
        """The hop the C chain stopped at, as if Python had written its STEP (`written`; else its step was pushed
        there and is awaited already, `expect`): its place among the replies taken, the bytes of its reply read so far
        handed to its FrameCall, and its reply read on from there (or the failure of its write or read raised as
        `send_blocking` / `receive_blocking` raise it)."""
        stream, call = hop.stream, hop.stream.call
        lost = OSError(stopped.errno, os.strerror(stopped.errno))
        if written:
            stream.relayed_step(4 * x.numel(), x.shape[1], tuple(x.shape), stopped.built_s, stopped.written_s)
            if stopped.state == relay.WRITE_TIMEOUT:
                raise ServerHung(hop.span.server_id, bound_s)
            if stopped.state == relay.WRITE_ERROR:  # (the server's STATUS, if it sent one before it closed)
                raise server_failure(hop.span, call._lost(lost))
        hop.written = 1  # (its STEP went whole: as `run_blocking` marks it before the read)
        call._buf += stopped.got
        if stopped.errno:  # (as FrameCall.read_blocking names a failed recv)
            raise server_failure(hop.span, rpc_error(grpc.StatusCode.UNAVAILABLE, f"connection lost: {lost}"))
        return stream.receive_blocking(max(stopped.left_s, 0.0), keep_undecoded, bound_s=bound_s)

    def _decode_outputs(self) -> None:
        """Outputs kept undecoded made tensors: an attempt that goes on in the event loop sends them from there."""
        for hop in self.hops:
            hop.outputs = [out.tensor() if isinstance(out, Undecoded) else out for out in hop.outputs]

    # ---- the two ways to run the hops ---------------------------------------------------------------------
    async def _hop_by_hop(self) -> tuple[dict[int, BaseException], bool]:
        """One message per hop: the sender and receiver hop after hop in this task (no tasks to wake). The
        watchdog's rule per hop: no progress for watchdog_s."""
        for i in range(len(self.hops)):
            try:
                async with asyncio.timeout(self.watchdog_s):
                    await self._send(i)
                    await self._receive(i)
            except TimeoutError:
                return {}, True
            except ServerFailed as exc:
                return {i: exc}, False  # hops before it answered, hops after it have nothing written
        return {}, False

    async def _pipelined(self) -> tuple[dict[int, BaseException], bool]:
        """A sender and a receiver task per hop; the first failure ends them all."""
        tasks = {asyncio.ensure_future(f(i)): i for i in range(len(self.hops)) for f in (self._send, self._receive)}
        try:
            stalled = await self._watch(tasks)
        finally:
            self.progress.stop()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        failed: dict[int, BaseException] = {}
        for t, i in tasks.items():
            exc = None if t.cancelled() else t.exception()
            if exc is not None:
                failed.setdefault(i, exc)
        return failed, stalled

    async def _watch(self, tasks: dict) -> bool:
        """Wait until every task is done or one fails; True if the pipeline made no progress for a whole
        watchdog_s. Every reply is bounded on its own (the hang timeout); this bounds the whole, whatever was
        missed."""
        seen = self.progress.generation
        while True:
            done, _ = await asyncio.wait(tasks, timeout=self.watchdog_s, return_when=asyncio.FIRST_EXCEPTION)
            if len(done) == len(tasks) or any(t.exception() for t in done if not t.cancelled()):
                return False
            if self.progress.generation == seen:
                return True
            seen = self.progress.generation

    # ---- one hop's sender and receiver --------------------------------------------------------------------
    def _source(self, i: int, k: int) -> torch.Tensor:
        """Hop i's input for chunk k: the chunk itself, or the previous hop's output."""
        return self.chunks[k][0] if i == 0 else self.hops[i - 1].outputs[k]

    def _push_targets(self, i: int, k: int) -> list[pb.PushTarget]:
        """Server-to-server push (server/push.py): the hops after hop i that have nothing of chunk k yet await it
        from the previous server (they take their stream's next step id now, so their replies can be read as soon
        as they come); the server of hop i is told to push on to them."""
        targets: list[pb.PushTarget] = []
        pusher = self.hops[i].open_span  # the server that pushes to the next target (its push key is sealed for it)
        for hop in self.hops[i + 1:] if self.push else ():
            if hop.claimed != k:  # a chunk of it is still to be sent by us: the push chain stops here
                break
            if k == 0 and hop.op != self.hops[i].op:  # a pushed step carries its sender's cache op on
                break
            hop.stream.expect(self.chunks[k][0].shape)
            hop.written = k + 1
            target = hop.stream
            targets.append(pb.PushTarget(address=hop.span.address, session_id=target.session_id,
                                         step_id=hop.base_id + k, secret=target.session_secret,
                                         push_key=pusher.sealed_push_key(target)))
            pusher = hop.open_span
        return targets

    async def _send(self, i: int) -> None:
        hop = self.hops[i]
        while hop.written < len(self.chunks):
            k = hop.written
            if i > 0:  # its input is the previous hop's output, unless that server pushes it here
                await self.progress.wait_for(lambda: self.hops[i - 1].answered > k or hop.claimed > k)
            if hop.claimed > k:  # awaited from a push (_push_targets advanced `written` with it)
                hop.written = max(hop.written, k + 1)
                continue
            targets = self._push_targets(i, k)
            await hop.stream.send(self._source(i, k), self._wire_mask(k), targets, hop.op if k == 0 else None,
                                  self.keep_routes)
            hop.written = max(hop.written, k + 1)
            self.progress.notify()

    async def _receive(self, i: int) -> None:
        hop = self.hops[i]
        while hop.answered < len(self.chunks):
            k = hop.answered
            # its input (the previous hop's output) is recorded with its output, so that reply is read first
            # (pushed, the next server may answer before the client has read it: its reply waits in the stream)
            await self.progress.wait_for(lambda: hop.written > k and (i == 0 or self.hops[i - 1].answered > k))
            x = self.chunks[k][0]
            cached = hop.open_span.cached  # (this chunk joins the history once answered)
            out, timing = await hop.stream.receive(self.hang_timeout(hop.span, x.shape[0], x.shape[1], cached))
            hop.open_span.answered(self._source(i, k), self.chunks[k][1])
            hop.outputs.append(out)
            self.timings.append(timing)
            self.progress.notify()
