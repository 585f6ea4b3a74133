"""The client's span streams: a session on one server, its steps written and its replies checked, from the client's
event loop or (framed streams) from the caller's own thread. Connections are client/channels.py's."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import grpc
import numpy as np
import torch

from swarmlm.client.channels import Channels
from swarmlm.client.chunking import BandwidthEstimate
from swarmlm.client.frame_call import FrameCall
from swarmlm.errors import InvalidRequest, PushRefused, ServerFailed, ServerHung, ServerTampered
from swarmlm.small_reads import all_set
from swarmlm.types import CacheOp, Span, StepKind
from swarmlm.wire import cache_op, codec, compact, compress, session_keys
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire.links import LinkScheduler
from swarmlm.wire.prefix_keys import RUN_TOKENS

log = logging.getLogger(__name__)
MAX_REPORTED_BATCH = 1 << 16  # a server's batch size is only reported; a larger claim is clamped, not trusted
_NO_MASK = pb.Tensor()  # a step without padding: an empty mask (copied into each request, never changed)


@dataclass(slots=True)
class HopTiming:
    """One step through one span, seen from both ends."""

    server_id: str
    wall_s: float  # client: request written -> reply parsed
    queued_s: float  # server: waiting for the compute thread
    compute_s: float  # server: running the blocks
    server_io_s: float  # server: parsing + validating + serialising
    client_io_s: float  # client: serialising the request + parsing the reply
    n_tokens: int
    pushed: bool = False  # the server pushed its output on to the next server of the route
    batched_steps: int = 1  # steps (of all sessions) that shared the server's forward

    @property
    def network_s(self) -> float:
        """What is left of the wall time: transfer, gRPC and event-loop overheads."""
        return network_s(self.wall_s, self.queued_s, self.compute_s, self.server_io_s)


def network_s(wall_s: float, queued_s: float, compute_s: float, server_io_s: float) -> float:
    """HopTiming.network_s of these times (also where a hop's timing is not made yet: SpanStream.relayed)."""
    return max(wall_s - queued_s - compute_s - server_io_s, 0.0)


# A hop the C chain answered, its timing not made yet (SpanStream.relayed; `relayed_timing` makes it): the server id,
# when the hop's wall time starts (its write, or the stream's previous reply if later), its tokens, then chain.c's
# ints and times of it (client/relay.py INTS, TIMES). Of atomic values only: the collector untracks such a tuple.
RelayedHop = tuple


def relayed_timing(hop: RelayedHop) -> HopTiming:
    """The HopTiming of a hop the C chain answered, as `_answer` makes a Python reader's."""
    server_id, started, n_tokens, _, _, batched, flags, queued, compute, parse, encode, t0, t1, t2, t3 = hop
    return HopTiming(server_id, wall_s=t2 - started, queued_s=queued, compute_s=compute, server_io_s=parse + encode,
                     client_io_s=(t1 - t0) + (t3 - t2), n_tokens=n_tokens, pushed=bool(flags & compact.PUSHED),
                     batched_steps=max(1, min(batched, MAX_REPORTED_BATCH)))


class Undecoded:
    """A reply's float32 hidden states, checked (header and length) but not made a tensor: a relayed hop's output
    goes on as its bytes (a compact STEP's values, or a Tensor message's: `as_sent`), and becomes a tensor only if
    something needs one (`tensor`: a failover's replay)."""

    __slots__ = ("data", "shape", "_tensor")

    def __init__(self, data: bytes | memoryview, shape: tuple[int, ...]) -> None:
        self.data = data  # the reply's (checked) float32 values: a REPLY's Tensor data, or a view of an ANSWER's
        self.shape = shape
        self._tensor: torch.Tensor | None = None

    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = codec.tensor_of(np.frombuffer(self.data, dtype=np.float32), self.shape, "reply hidden")
        return self._tensor

    def as_sent(self) -> pb.Tensor:
        """The same values as a protobuf request's: a fresh message of the data, dtype and shape (nothing else of
        the reply goes on)."""
        return pb.Tensor(data=bytes(self.data), dtype="float32", shape=self.shape)


def server_failure(span: Span, exc: BaseException) -> ServerFailed:
    """What a stream's error (gRPC's, a framed call's, an OSError) says of the span's server."""
    """What a stream's error (gRPC's, a framed call's, an OSError) says of its server."""
    if isinstance(exc, grpc.aio.AioRpcError) and session_keys.TAMPERED in (exc.details() or ""):
        return ServerTampered(span.server_id, f"{exc.code().name}: {exc.details()}")  # (our message was changed)
    if isinstance(exc, grpc.aio.AioRpcError):
        return ServerFailed(span.server_id, f"{exc.code().name}: {exc.details()}")
    return ServerFailed(span.server_id, f"{type(exc).__name__}: {exc}")


@dataclass
class _Sent:
    """A step written on the stream whose reply has not been read yet."""

    kind: StepKind
    n_tokens: int
    request_bytes: int
    encode_s: float
    clean: bool  # nothing else of this client was in flight on the link: its timing measures the link
    written_s: float = 0.0  # perf_counter when its write began (`send`: set again at its turn on the link)
    on_link: bool = True  # False: pushed here by the previous server, not written by this client
    step_id: int = 0
    # a compact STEP's [B, T, H], or a pushed decode step's (its pusher may push it compact): its ANSWER has as many
    # values; None: answered by a REPLY only
    shape: tuple[int, ...] | None = None


_ROUTE_UNKNOWN: tuple = ()  # (SpanStream._route: matches no route, and is not None)


def _raise_if_cancelling() -> None:
    """grpc.aio raises CancelledError on every operation of a call cancelled elsewhere (an interrupted read):
    that is a broken stream. Only a cancellation of the running task itself is passed on as one."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class SpanStream:
    """A session on one server: an open bidirectional stream; steps go in order.

    `send` and `receive` are separate so a prefill's chunks can be pipelined: chunk k+1 is written while chunk k is
    computed, and replies are read in order by another task. Every write waits for its turn on the link.

    The session is keyed end to end with the server's signed key share (wire/session_keys.py): every message
    carries our MAC, and a reply whose MAC does not match is the server's failure (whoever changed it on the way:
    the failover routes around that server and its relay)."""

    def __init__(self, channels: Channels, span: Span, timeout_s: float) -> None:
        self.channels = channels
        self.span = span
        self.timeout_s = timeout_s
        self.call = None
        self.session_id = ""
        self.session_secret = b""
        self.keys: session_keys.SessionKeys | None = None  # set by open()
        self.position = 0
        self._step_id = 0
        # the route the server keeps for this stream's steps (protocol 4, docs/PROTOCOL.md "Kept routes"): its
        # targets' (session, step id) as the last step named them; None: it keeps none (a STEP is answered alone);
        # _ROUTE_UNKNOWN: not known (after a refusal)
        self._route: tuple[tuple[str, int], ...] | None = None
        self._pending: deque[_Sent] = deque()  # written (or being written), reply not read yet; in order
        self._last_reply_s = 0.0
        # the link scheduler of this span's address (the client's one for it: Links never replaces one), kept as an
        # attribute: read on every step
        self.link: LinkScheduler = channels.link(span.address)
        self._bandwidth: BandwidthEstimate | None = None

    @property
    def unanswered(self) -> int:
        return len(self._pending)

    @property
    def next_step_id(self) -> int:
        """Every step of this stream takes the next id, written here or pushed here by another server."""
        return self._step_id + 1

    def expect(self, shape: torch.Size) -> None:
        """Await the reply to a step of `shape` [B, T, H] the previous server pushed to this session (it takes the
        next id). A decode step's may be an ANSWER: its pusher pushes it as a compact PUSH_STEP when it can."""
        self._step_id += 1
        n_tokens = shape[1]
        self._pending.append(_Sent(StepKind.of(n_tokens), n_tokens, 0, 0.0, clean=False, written_s=time.perf_counter(),
                                   on_link=False, step_id=self._step_id,
                                   shape=tuple(shape) if self._compact(shape) else None))

    async def open(self, batch: int, max_length: int, prefix_scope: bytes = b"",
                   prefix_keys: Sequence[bytes] = (), prompts: torch.Tensor | None = None,
                   lora: Sequence[pb.LoraWeights] = ()) -> int:
        """Open the session; with prefix keys, it may start from a cached prefix: returns the tokens it holds.
        prompts: the span's deep prompt [span blocks, K, H]; lora: a client's own LoRA on the span's blocks
        (docs/PROTOCOL.md)."""
        share = self.channels.key_shares.get(self.span.server_id, b"")
        try:
            key_share, self.keys = session_keys.client_keys(share)
        except ValueError as exc:  # (its Info was never checked here, or gave no key)
            raise ServerFailed(self.span.server_id, f"no session key from its signed Info ({exc})") from None
        request = pb.InferenceRequest(open=pb.OpenSession(
            start_block=self.span.start, end_block=self.span.end, batch_size=batch, max_length=max_length,
            adapter=self.channels.adapter, prompts=codec.encode(prompts) if prompts is not None else None,
            lora=list(lora), prefix_scope=prefix_scope, prefix_keys=list(prefix_keys), key_share=key_share))
        signed = session_keys.sign(self.keys.client, "", request)
        try:
            try:
                reply = await self._first_reply(signed)
            except grpc.aio.AioRpcError as exc:
                if not (isinstance(self.call, FrameCall) and self.call.reused
                        and exc.code() == grpc.StatusCode.UNAVAILABLE):
                    raise
                # a kept connection the server closed as we took it (its idle timeout): once more, on a new one
                self.channels.end_stream(self.span.address, self.call)
                reply = await self._first_reply(signed, fresh=True)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, OSError) as exc:
            await self.close()
            raise server_failure(self.span, exc) from exc
        if reply is grpc.aio.EOF:
            raise ServerFailed(self.span.server_id, "stream closed while opening a session")
        if not session_keys.verified(self.keys.server, reply.session_id, reply):
            await self.close()
            raise ServerTampered(self.span.server_id, session_keys.REPLY_TAMPERED)
        self.session_id = reply.session_id
        self.session_secret = reply.session_secret  # push needs it: handed to the servers of this route only
        held = reply.prefix_tokens
        if held % RUN_TOKENS or held > len(prefix_keys) * RUN_TOKENS or held != reply.position:
            await self.close()
            raise ServerFailed(self.span.server_id, f"open reply claims {held} cached tokens for "
                                                    f"{len(prefix_keys)} keys")
        self.position = held
        return held

    async def _first_reply(self, request: pb.InferenceRequest, fresh: bool = False):
        self.call = await self.channels.open_stream(self.span.address, fresh=fresh)
        await self.call.write(request)
        async with asyncio.timeout(self.timeout_s):
            return await self.call.read()

    async def save(self, keys: Sequence[bytes]) -> None:
        """Ask the server to keep the first len(keys) runs of tokens the session holds (no reply unless refused)."""
        if self.call is None:  # closed already: nothing to keep
            return
        try:
            await self.call.write(session_keys.sign(self.keys.client, self.session_id,
                                                    pb.InferenceRequest(save=pb.PrefixSave(keys=list(keys)))))
        except (grpc.aio.AioRpcError, OSError, asyncio.InvalidStateError) as exc:
            raise server_failure(self.span, exc) from exc

    def _request(self, source: torch.Tensor | Undecoded, mask: torch.Tensor | None, push: list[pb.PushTarget],
                 op: CacheOp | None, keep: bool = False) -> tuple[pb.InferenceRequest | bytes, _Sent]:
        """The next step's message, and its place among the replies (taken now, with its id). `source`: the hidden
        states [B, T, H], a tensor or a relayed reply kept `Undecoded` (its float32 bytes go on as they came when
        this link's format is float32; another format encodes its tensor). A plain decode step on a framed stream
        (`_compact`) is a whole STEP frame (wire/compact.py), anything else an InferenceRequest.

        `keep`: a plain decode step pushed on to `push` may have the server keep that route (protocol 4, "Kept
        routes"): the first such step is a REQUEST with keep_route, the next ones, while `push` names the same
        sessions each one step id on, go as a STEP (the server pushes it on its route). Any other step of this
        stream is a REQUEST without keep_route (the server drops its route) until a route is kept again."""
        t0 = time.perf_counter()
        self._step_id += 1
        # the link's wire format, asked once per step (for a relayed reply its float32 bytes are its size already)
        if type(source) is Undecoded:
            encoded, hidden, shape = source, None, source.shape
            wire_dtype = self.channels.wire_dtype_for(self.span.address, len(source.data))
            if wire_dtype != "float32":  # (another wire format: encoded here from its tensor)
                encoded, hidden = None, source.tensor()
        else:
            encoded, hidden, shape = None, source, source.shape
            wire_dtype = self.channels.wire_dtype_for(self.span.address, 4 * source.numel())
        unmasked = mask is None or all_set(mask)
        # a plain decode step goes as a STEP, or, with push targets, as a REQUEST answered by an ANSWER
        # (server/service.py `_answers_compact`): either way its answer may be compact, of its dims
        plain = unmasked and op is None and wire_dtype == "float32" and self._compact(shape)
        compact_shape = tuple(shape) if plain else None
        route = None  # (the route this step keeps, or goes on)
        if keep and plain and push:
            route = tuple((target.session_id, target.step_id) for target in push)
            on_route = self.on_kept_route(route)
        else:
            on_route = False
        # a STEP goes on the route the server keeps, if it keeps one: so only a step on that route, or any plain
        # step of a stream whose server keeps none
        if plain and (on_route or not push and self._route is None):
            b, t, h = shape
            values = encoded.data if encoded is not None else compact.float32_values(hidden)
            request = compact.step_frame(self.keys.client, self.session_id, self._step_id, b, t, h, values)
            nbytes = 4 * b * t * h
        else:
            request = pb.InferenceRequest(step=pb.InferenceStep(
                hidden=encoded.as_sent() if encoded is not None else compress.encode_hidden(hidden, wire_dtype),
                step_id=self._step_id, push=push, cache_op=cache_op.to_wire(op) if op is not None else None,
                # (no padding: no mask on the wire, the server reads an absent mask as all ones)
                attention_mask=_NO_MASK if unmasked else codec.encode(mask), keep_route=route is not None))
            session_keys.sign(self.keys.client, self.session_id, request)
            nbytes = len(request.step.hidden.data)
        self._route = route  # (kept, gone on, or dropped by the server as it takes this step)
        t1 = time.perf_counter()  # (also the blocking write's start: `send_blocking` writes it at once)
        sent = _Sent(StepKind.of(shape[1]), n_tokens=shape[1], request_bytes=nbytes, encode_s=t1 - t0, clean=False,
                     written_s=t1, on_link=False, step_id=self._step_id, shape=compact_shape)
        self._pending.append(sent)
        return request, sent

    def on_kept_route(self, route: tuple[tuple[str, int], ...]) -> bool:
        """Is `route` (a pushed plain decode step's targets: session id, step id) the route the server keeps for this
        stream, each target one step on? Such a step goes as a STEP, which the server pushes on (`_request`; the C
        chain's pushed step, pipeline.py `_relayable`, asks the same)."""
        return route == self._route_on()

    def went_on_route(self) -> None:
        """A STEP went on the kept route (the C chain wrote it): the route one step on, as `_request` records the
        route its step goes on."""
        self._route = self._route_on()

    def _route_on(self) -> tuple[tuple[str, int], ...] | None:
        """The kept route one step on (each target's next step id: what the next step on it names); None: none kept
        (or not known)."""
        return tuple((sid, step_id + 1) for sid, step_id in self._route) if self._route else None

    @property
    def keeps_route(self) -> bool:
        """Does the server keep a route for this stream's steps (a STEP written here would be pushed on)?"""
        return self._route is not None

    def _compact(self, shape: torch.Size) -> bool:
        """May a plain (no mask, push or cache op; float32) step of `shape` go as a compact STEP? A decode step of a
        keyed session on a framed stream (its B and T within the header's fields)."""
        return shape[1] == 1 and type(self.call) is FrameCall and self.keys is not None and \
            compact.eligible_dims(shape[0], shape[1])

    async def send(self, hidden: torch.Tensor, mask: torch.Tensor | None, push: list[pb.PushTarget] = (),
                   op: CacheOp | None = None, keep: bool = False) -> None:
        """Write one step (hidden [B, T, H], mask [B, T]) when the link scheduler gives it its turn; `push`: the
        rest of the route, for the server to push its output on (server/push.py); `op`: the cache edit the server
        applies before the step's tokens (docs/PROTOCOL.md), pushed on with it; `keep`: the server may keep the
        route (`_request`)."""
        request, sent = self._request(hidden, mask, push, op, keep)
        link = self.link
        async with link.turn(sent.kind):
            sent.on_link = True  # from here the link counts it until its reply or close()
            sent.clean = link.in_flight == 1 and len(self._pending) == 1
            # the hop's time starts with the write, not when it returns: gRPC's write waits for HTTP/2 flow
            # control, so a large message is mostly across the link by then (and would read as a fast link)
            sent.written_s = time.perf_counter()
            try:
                await self.call.write(request)
            except (grpc.aio.AioRpcError, OSError, asyncio.InvalidStateError) as exc:
                raise server_failure(self.span, exc) from exc
            except asyncio.CancelledError as exc:
                _raise_if_cancelling()
                raise ServerFailed(self.span.server_id, "stream cancelled") from exc

    @property
    def blocking_ok(self) -> bool:
        """A step may be written and answered from the caller's thread (`send_blocking`, `receive_blocking`): a
        framed stream with nothing in flight."""
        return isinstance(self.call, FrameCall) and self.call.blocking_ok and not self._pending

    def send_blocking(self, source: torch.Tensor | Undecoded, mask: torch.Tensor | None, timeout_s: float,
                      push: list[pb.PushTarget] = (), op: CacheOp | None = None, keep: bool = False) -> None:
        """`send` from the caller's thread (`blocking_ok` streams only): no hand-off to the client's loop thread. It
        does not ask the link scheduler for a turn (that lives on the loop thread): a decode step goes first there
        anyway. `source`, `keep`: see `_request`."""
        request, sent = self._request(source, mask, push, op, keep)
        link = self.link
        sent.clean = link.in_flight == 0 and len(self._pending) == 1  # (a read from another thread: a hint)
        link.written_outside(sent.kind)
        try:
            self.call.write_blocking(request, timeout_s)
        except TimeoutError as exc:
            raise ServerHung(self.span.server_id, timeout_s) from exc
        except (grpc.aio.AioRpcError, OSError, asyncio.InvalidStateError) as exc:
            raise server_failure(self.span, exc) from exc

    def receive_blocking(self, timeout_s: float, keep_undecoded: bool = False,
                         bound_s: float | None = None) -> tuple[torch.Tensor | Undecoded, HopTiming]:
        """`receive` in the caller's thread: it sleeps on the socket itself until the reply comes. `keep_undecoded`:
        a float32 output is checked as ever but given as `Undecoded` (a relayed hop's: its bytes go on). `bound_s`:
        the reply's whole hang bound, when `timeout_s` is what is left of it (the C chain waited the rest)."""
        try:
            reply = self.call.read_blocking(timeout_s)
        except TimeoutError as exc:
            raise ServerHung(self.span.server_id, timeout_s if bound_s is None else bound_s) from exc
        except (grpc.aio.AioRpcError, OSError, asyncio.InvalidStateError) as exc:
            raise server_failure(self.span, exc) from exc
        return self._answer(reply, time.perf_counter(), keep_undecoded)

    # ---- a hop of the C chain (client/relay.py) ------------------------------------------------------------
    def relayed_step(self, nbytes: int, n_tokens: int, shape: tuple[int, ...], built_s: float,
                     written_s: float) -> None:
        """A compact STEP the C chain wrote (or began to write) on this stream: its id taken and its place among the
        replies, as `send_blocking`'s `_request` would (its reply is then read here, `receive_blocking`)."""
        self._step_id += 1
        kind = StepKind.of(n_tokens)
        self._pending.append(_Sent(kind, n_tokens, nbytes, written_s - built_s, clean=self.link.in_flight == 0,
                                   written_s=written_s, on_link=False, step_id=self._step_id, shape=shape))
        self.link.written_outside(kind)

    def relayed(self, ints: list[int], times: list[float], nbytes: int, n_tokens: int,
                pushed_here: bool = False) -> RelayedHop:
        """A hop the C chain wrote and took the ANSWER of (its kind, length, MAC and step id checked there): the
        step's id, the stream's position and the link's bandwidth as `_request` and `_answer` keep them;
        `pushed_here`: its step was pushed here by the previous server, not written by this client (as `expect`
        awaits one: no message on the link, no bandwidth sample, its wall time from hop 0's write). ints: the
        ANSWER's step id, position, batched steps, flags; times: its queued, compute, parse, encode, then the
        client's clock when the STEP's build began, its write began, the reply was whole, it was checked. Returns
        its timing not made yet (`relayed_timing` makes it: a relay lane's step record when it is first read)."""
        self._step_id += 1
        assert ints[0] == self._step_id  # (the id the chain was given, and checked)
        if not pushed_here:
            self.link.written_outside(StepKind.of(n_tokens))
        self.position = ints[1]
        queued, compute, parse, encode, _, t1, t2, _ = times
        started = t1 if t1 > self._last_reply_s else self._last_reply_s
        self._last_reply_s = t2
        if not pushed_here and self.link.in_flight == 0:  # (`_Sent.clean`: nothing else of this client on the link)
            if self._bandwidth is None:
                self._bandwidth = self.channels.bandwidth(self.span.address)
            self._bandwidth.observe(2 * nbytes, network_s(t2 - started, queued, compute, parse + encode))
        return (self.span.server_id, started, n_tokens, *ints, *times)

    async def receive(self, timeout_s: float | None = None) -> tuple[torch.Tensor, HopTiming]:
        """The reply to the oldest unanswered step. No reply within `timeout_s` (default: the stream's) is a failure
        of this server: it is alive (the stream did not break) but not answering."""
        if not self._pending:
            raise RuntimeError("receive() without a step sent")
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancellation that comes as the read
            # completes, and a cancelled pipeline task would then run on and wait forever
            async with asyncio.timeout(timeout_s):
                reply = await self.call.read()
        except asyncio.TimeoutError as exc:
            raise ServerHung(self.span.server_id, timeout_s) from exc
        except (grpc.aio.AioRpcError, OSError, asyncio.InvalidStateError) as exc:
            raise server_failure(self.span, exc) from exc
        except asyncio.CancelledError as exc:
            _raise_if_cancelling()
            raise ServerFailed(self.span.server_id, "stream cancelled") from exc
        return self._answer(reply, time.perf_counter())

    def _answer(self, reply, t2: float, keep_undecoded: bool = False) -> tuple[torch.Tensor | Undecoded, HopTiming]:
        """The oldest unanswered step's reply (read at `t2`), checked: its output and timing."""
        sent = self._pending.popleft()
        if sent.on_link:
            self.link.answered(sent.kind)
        if reply is grpc.aio.EOF:
            raise ServerFailed(self.span.server_id, "stream closed by the server")
        if type(reply) is compact.Answer:  # a compact STEP's (wire/compact.py): its timing is its own fields
            out, reply_bytes = self._compact_output(reply, sent, keep_undecoded)
            tm = reply
        else:
            if not session_keys.verified(self.keys.server, self.session_id, reply):
                raise ServerTampered(self.span.server_id, session_keys.REPLY_TAMPERED)
            out, reply_bytes = self._reply_output(reply, sent, keep_undecoded)
            tm = reply.timing
        if reply.step_id != sent.step_id:
            raise ServerFailed(self.span.server_id, f"reply to step {reply.step_id}, expected step {sent.step_id}")
        t3 = time.perf_counter()
        self.position = reply.position
        # a pipelined chunk waits at the server until the previous one is answered: its wall time starts then
        started = max(sent.written_s or t2, self._last_reply_s)
        self._last_reply_s = t2
        timing = HopTiming(
            self.span.server_id, wall_s=t2 - started, queued_s=tm.queued_s, compute_s=tm.compute_s,
            server_io_s=tm.parse_s + tm.encode_s, client_io_s=sent.encode_s + (t3 - t2), n_tokens=sent.n_tokens,
            pushed=reply.pushed, batched_steps=max(1, min(tm.batched_steps, MAX_REPORTED_BATCH)),
        )
        if sent.clean:
            if self._bandwidth is None:  # (the client's estimate of this address: Channels never replaces one)
                self._bandwidth = self.channels.bandwidth(self.span.address)
            self._bandwidth.observe(sent.request_bytes + reply_bytes, timing.network_s)
        return out, timing

    def _reply_output(self, reply: pb.InferenceReply, sent: _Sent,
                      keep_undecoded: bool) -> tuple[torch.Tensor | Undecoded, int]:
        """A REPLY's output (its MAC checked already) and its bytes; a refusal raised (a refused STEP's too)."""
        if reply.HasField("error"):
            # (a refused step changes nothing at the server: whatever route it kept before, it keeps; the next step
            # here is a REQUEST, which says whether to keep one)
            self._route = _ROUTE_UNKNOWN
            refusal = PushRefused if reply.error.code == "PUSH_REFUSED" else InvalidRequest
            raise refusal(f"{self.span.server_id}: {reply.error.message}")
        hidden = reply.hidden
        if keep_undecoded and hidden.dtype == "float32":
            shape = codec.checked(hidden, "reply hidden")
            data = hidden.data
            return Undecoded(data, shape), len(data)
        return codec.decode(hidden, "reply hidden"), len(hidden.data)

    def _compact_output(self, answer: compact.Answer, sent: _Sent,
                        keep_undecoded: bool) -> tuple[torch.Tensor | Undecoded, int]:
        """An ANSWER's output, checked: its MAC under the server key, then its length for the STEP's dims."""
        if sent.shape is None:
            raise ServerFailed(self.span.server_id, "an ANSWER to a step that was not a compact STEP")
        b, t, h = sent.shape
        try:
            answer.opened(self.keys.server, self.session_id, b * t * h)
        except compact.Tampered:
            raise ServerTampered(self.span.server_id, session_keys.REPLY_TAMPERED) from None
        except InvalidRequest as exc:
            raise ServerFailed(self.span.server_id, str(exc)) from None
        data = answer.values
        if keep_undecoded:
            return Undecoded(data, sent.shape), len(data)
        return codec.tensor_of(np.frombuffer(data, dtype=np.float32), sent.shape, "reply hidden"), len(data)

    async def step(self, hidden: torch.Tensor, mask: torch.Tensor | None,
                   timeout_s: float | None = None, op: CacheOp | None = None) -> tuple[torch.Tensor, HopTiming]:
        """One step, written and answered (nothing else of this stream in flight)."""
        await self.send(hidden, mask, op=op)
        return await self.receive(timeout_s)

    async def close(self) -> None:
        while self._pending:  # never answered: free their places on the link
            sent = self._pending.popleft()
            if sent.on_link:
                self.link.answered(sent.kind)
        if self.call is not None:
            try:
                await self.call.done_writing()  # a clean end: the server closes the session now
                async with asyncio.timeout(2.0):
                    await self.call.read()  # its end of stream
            except (Exception, asyncio.CancelledError):
                # already broken, or cancelled by an interrupted read (grpc.aio then raises CancelledError on
                # every operation): the server expires the session on its own. A cancellation of *this* task
                # still propagates.
                _raise_if_cancelling()
            self.channels.end_stream(self.span.address, self.call)  # (a clean framed one: kept for the next)
            self.call = None
