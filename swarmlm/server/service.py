"""The gRPC service: decode and validate what a peer sends, hand compute to the scheduler, encode the reply.

Bad input gets a clear error and changes nothing: steps are fully validated before any compute, and a session's
cache and mask only change when its step succeeds.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc
import torch

from swarmlm import __version__
from swarmlm.config import ServerConfig
from swarmlm.errors import CapacityExceeded, InvalidRequest, UnknownSession
from swarmlm.server.push import Pusher, StepOrder, check_targets
from swarmlm.server.scheduler import PREFILL, Scheduler
from swarmlm.server.sessions import Session, SessionTable
from swarmlm.server.stage import Stage
from swarmlm.types import BlockRange
from swarmlm.wire import codec
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire import swarm_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
INBOX_SIZE = 8  # steps of one session waiting to run; a full inbox holds the client's stream and pushers back
PUSH_WAIT_S = 30.0  # how long a push may wait for room in a session's inbox
_END = object()  # the client half-closed its stream
_BROKEN = object()  # the client's stream broke
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MASK_DTYPES = (torch.int64, torch.int32, torch.uint8, torch.bool)


@dataclass
class ServerStats:
    """What the server announces about itself besides its range."""

    server_id: str = ""
    model: str = ""
    decode_s_per_block: float = 0.0
    prefill_a_s: float = 0.0
    prefill_b_s: float = 0.0


class SwarmService(pb_grpc.SwarmServicer):
    def __init__(self, config: ServerConfig, stage: Stage, scheduler: Scheduler, stats: ServerStats) -> None:
        self.config = config
        self.stage = stage
        self.scheduler = scheduler
        self.stats = stats
        self.sessions = SessionTable(config.cache_bytes, config.max_sessions)
        self.attached: set[str] = set()  # sessions held by a live stream
        self.inboxes: dict[str, asyncio.Queue] = {}  # per attached session: its steps, from the stream and pushes
        self.pusher = Pusher(config.max_message_bytes)
        self._pushes: dict[str, asyncio.Task] = {}  # per session: its latest push (pushes of a session go in order)
        self.accepting = True  # False while draining for shutdown: new sessions go elsewhere
        self.num_model_blocks = int(stage.config.num_hidden_layers)

    # ---- validation -------------------------------------------------------------------------------------
    def _check_range(self, start: int, end: int) -> BlockRange:
        if not (self.stage.blocks.start <= start < end <= self.stage.blocks.end):
            raise InvalidRequest(f"blocks [{start}, {end}) are not inside this server's {self.stage.blocks}")
        return BlockRange(start, end)

    def _hidden(self, msg: pb.Tensor, batch: int | None) -> torch.Tensor:
        hidden = codec.decode(msg, "hidden", max_elements=self.config.max_message_bytes // 2)
        if hidden.dtype not in FLOAT_DTYPES:
            raise InvalidRequest(f"hidden: dtype {hidden.dtype} is not a float type")
        if hidden.dim() != 3:
            raise InvalidRequest(f"hidden: expected shape [batch, tokens, {self.stage.hidden_size}], got {list(hidden.shape)}")
        b, t, h = hidden.shape
        if h != self.stage.hidden_size:
            raise InvalidRequest(f"hidden: hidden size {h} does not match the model's {self.stage.hidden_size}")
        if t < 1 or b < 1:
            raise InvalidRequest(f"hidden: empty shape {list(hidden.shape)}")
        if batch is not None and b != batch:
            raise InvalidRequest(f"hidden: batch {b} does not match the session's batch {batch}")
        if b > self.config.max_batch:
            raise InvalidRequest(f"hidden: batch {b} exceeds the limit of {self.config.max_batch}")
        if not torch.isfinite(hidden).all():
            raise InvalidRequest("hidden: contains NaN or infinite values")
        return hidden

    def _mask(self, msg: pb.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        b, t, _ = hidden.shape
        if not codec.is_set(msg):
            return torch.ones(b, t, dtype=torch.long)
        mask = codec.decode(msg, "attention_mask", max_elements=b * t)
        if mask.dtype not in MASK_DTYPES or tuple(mask.shape) != (b, t):
            raise InvalidRequest(f"attention_mask: expected an integer [{b}, {t}] tensor, got {mask.dtype} {list(mask.shape)}")
        mask = mask.to(torch.long)
        if ((mask != 0) & (mask != 1)).any():
            raise InvalidRequest("attention_mask: values must be 0 or 1")
        return mask

    def _open(self, msg: pb.OpenSession) -> Session:
        blocks = self._check_range(msg.start_block, msg.end_block)
        if not 1 <= msg.batch_size <= self.config.max_batch:
            raise InvalidRequest(f"batch_size must be in [1, {self.config.max_batch}], got {msg.batch_size}")
        if not 1 <= msg.max_length <= self.config.max_length_tokens:
            raise InvalidRequest(f"max_length must be in [1, {self.config.max_length_tokens}], got {msg.max_length}")
        nbytes = self.stage.cache_bytes(blocks.length, msg.batch_size, msg.max_length)
        state = self.stage.new_state(blocks, msg.batch_size, msg.max_length)
        return self.sessions.open(state, msg.batch_size, msg.max_length, nbytes)

    # ---- RPCs -------------------------------------------------------------------------------------------
    async def Inference(self, request_iterator, context: grpc.aio.ServicerContext):
        """One session. Its steps come from this stream and from pushes (an inbox merges them); `StepOrder` runs
        each step id once, in order; every reply goes back on this stream."""
        session: Session | None = None
        clean_end = False
        reader: asyncio.Task | None = None
        ended = asyncio.Event()  # the client half-closed its stream
        try:
            first = await self._next(request_iterator)
            if first is None:
                return
            session = await self._attach(first, context)
            inbox: asyncio.Queue = asyncio.Queue(maxsize=INBOX_SIZE)
            self.inboxes[session.session_id] = inbox
            if first.WhichOneof("kind") == "step":
                order = StepOrder(last_id=max(first.step.step_id - 1, 0))
                inbox.put_nowait(first)
            else:
                order = StepOrder()
                yield pb.InferenceReply(session_id=session.session_id, position=session.state.position)
            reader = asyncio.ensure_future(self._read(request_iterator, inbox, ended))
            while True:
                async with asyncio.timeout(self.config.session_idle_timeout_s):  # (wait_for may drop a cancellation)
                    request = await inbox.get()
                if request is _END or request is _BROKEN:
                    clean_end = request is _END
                    return
                try:
                    ready = order.admit(request)
                except InvalidRequest as exc:
                    yield self._refused(session, request.step.step_id, exc)
                    continue
                for step in ready:
                    reply = await self._step(session, step, context)
                    yield reply  # first: pushing on is not on the way of this reply
                    if reply.pushed:
                        self._push_after(session.session_id, reply, step)
        except asyncio.TimeoutError:
            if session is not None:
                self.sessions.close(session.session_id)
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no message for {self.config.session_idle_timeout_s} s: session closed",
            )
        finally:
            if reader is not None:
                reader.cancel()
            if session is not None:
                self.attached.discard(session.session_id)
                self.inboxes.pop(session.session_id, None)
                if clean_end or ended.is_set():
                    self.sessions.close(session.session_id)

    @staticmethod
    async def _read(request_iterator, inbox: asyncio.Queue, ended: asyncio.Event) -> None:
        """The client's messages into the inbox; a full inbox holds the stream back (HTTP/2 flow control)."""
        try:
            async for request in request_iterator:
                await inbox.put(request)
        except Exception:  # a broken stream: the session stays for a resume until its idle timeout
            await inbox.put(_BROKEN)
            return
        ended.set()  # a clean end, even if the call is cancelled before the handler reads it
        await inbox.put(_END)

    async def Push(self, request: pb.PushRequest, context) -> pb.PushReply:
        """A step pushed by the previous server of a route; accepted only into a session a client's stream holds
        (its reply has to go somewhere). Validated like any step when its turn comes."""
        inbox = self.inboxes.get(request.session_id)
        if inbox is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no stream holds session {request.session_id[:80]!r} here")
        if request.step.step_id == 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a pushed step needs a nonzero step id")
        try:  # a full inbox holds the pusher back, as a full stream holds the client back
            async with asyncio.timeout(PUSH_WAIT_S):
                await inbox.put(pb.InferenceRequest(session_id=request.session_id, step=request.step))
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the session has too many steps waiting")
        return pb.PushReply()

    async def _next(self, request_iterator) -> pb.InferenceRequest | None:
        try:
            async with asyncio.timeout(self.config.session_idle_timeout_s):
                return await request_iterator.__anext__()
        except StopAsyncIteration:
            return None

    async def _attach(self, first: pb.InferenceRequest, context) -> Session:
        kind = first.WhichOneof("kind")
        try:
            if kind == "open":
                if not self.accepting:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
                session = self._open(first.open)
            elif kind == "step" and first.session_id:
                session = self.sessions.get(first.session_id)
                if session.session_id in self.attached:
                    raise InvalidRequest(f"session {first.session_id} is held by another stream")
            else:
                raise InvalidRequest("the first message of a stream must open a session or name an open one")
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except CapacityExceeded as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except UnknownSession as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
        self.attached.add(session.session_id)
        return session

    async def _step(self, session: Session, request: pb.InferenceRequest, context) -> pb.InferenceReply:
        sid = session.session_id
        step_id = request.step.step_id
        started = time.perf_counter()
        try:
            if request.session_id and request.session_id != sid:
                raise InvalidRequest(f"this stream holds session {sid}, not {request.session_id}")
            if request.WhichOneof("kind") != "step":
                raise InvalidRequest("a session is already open on this stream: expected a step")
            self.sessions.get(sid)  # refreshes last use; raises if expired meanwhile
            hidden = self._hidden(request.step.hidden, session.batch)
            mask = self._mask(request.step.attention_mask, hidden)
            if session.state.position + hidden.shape[1] > session.max_length:
                raise InvalidRequest(
                    f"step of {hidden.shape[1]} tokens would exceed the session's max_length {session.max_length}"
                    f" (it holds {session.state.position})"
                )
            check_targets(request.step.push)
        except InvalidRequest as exc:
            return self._refused(session, step_id, exc)
        except UnknownSession as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
        decoded = time.perf_counter()
        try:  # batched with other sessions' steps of the same shape; decode steps go first
            out, timing = await self.scheduler.submit_step(self.stage, session.state, hidden, mask)
        except Exception as exc:  # unexpected (a bug or an OOM): close the session rather than trust it
            log.exception("step failed")
            self.sessions.close(sid)
            await context.abort(grpc.StatusCode.INTERNAL, f"step failed, session closed: {exc}")
        encode_start = time.perf_counter()
        reply_hidden = codec.encode(out.to(hidden.dtype))
        encode_s = time.perf_counter() - encode_start
        return pb.InferenceReply(
            session_id=sid, step_id=step_id, hidden=reply_hidden, position=session.state.position,
            pushed=len(request.step.push) > 0,
            timing=pb.Timing(
                queued_s=timing.queued_s, compute_s=timing.compute_s, decode_s=decoded - started, encode_s=encode_s,
                batch_size=timing.batch_size,
            ),
        )

    def _push_after(self, sid: str, reply: pb.InferenceReply, request: pb.InferenceRequest) -> None:
        """Push a step's output on to the next server, after this session's earlier pushes (in step order). A push
        that fails is logged: the client's stream to that server then breaks or times out, and its failover
        re-sends the step."""
        targets = list(request.step.push)
        previous = self._pushes.get(sid)

        async def push() -> None:
            if previous is not None:
                await asyncio.gather(previous, return_exceptions=True)
            if not await self.pusher.push(targets[0], reply.hidden, request.step.attention_mask, targets[1:]):
                log.warning("push of step %d of session %s to %s failed", request.step.step_id, sid,
                            targets[0].address)
            if self._pushes.get(sid) is task:
                del self._pushes[sid]

        task = asyncio.ensure_future(push())
        self._pushes[sid] = task

    @staticmethod
    def _refused(session: Session, step_id: int, exc: Exception) -> pb.InferenceReply:
        return pb.InferenceReply(
            session_id=session.session_id, step_id=step_id, position=session.state.position,
            error=pb.Error(code="INVALID_ARGUMENT", message=str(exc)),
        )

    async def Forward(self, request: pb.ForwardRequest, context) -> pb.ForwardReply:
        started = time.perf_counter()
        try:
            blocks = self._check_range(request.start_block, request.end_block)
            hidden = self._hidden(request.hidden, None)
            mask = self._mask(request.attention_mask, hidden)
            if hidden.shape[1] > self.config.max_length_tokens:
                raise InvalidRequest(f"{hidden.shape[1]} tokens exceed the limit of {self.config.max_length_tokens}")
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        decoded = time.perf_counter()
        out, timing = await self.scheduler.submit(
            lambda: self.stage.forward(blocks, hidden, mask), PREFILL, tokens=hidden.shape[0] * hidden.shape[1]
        )
        encode_start = time.perf_counter()
        reply = codec.encode(out.to(hidden.dtype))
        return pb.ForwardReply(
            hidden=reply,
            timing=pb.Timing(queued_s=timing.queued_s, compute_s=timing.compute_s, decode_s=decoded - started,
                             encode_s=time.perf_counter() - encode_start, batch_size=timing.batch_size),
        )

    async def Info(self, request: pb.InfoRequest, context) -> pb.InfoReply:
        return self.info()

    def info(self) -> pb.InfoReply:
        return pb.InfoReply(
            server_id=self.stats.server_id, model=self.stats.model,
            start_block=self.stage.blocks.start, end_block=self.stage.blocks.end,
            num_blocks=self.num_model_blocks, hidden_size=self.stage.hidden_size, dtype=self.config.dtype,
            cache_bytes_total=self.sessions.cache_bytes, cache_bytes_free=self.sessions.free_bytes,
            active_sessions=len(self.sessions.sessions), queue_length=self.scheduler.queue_length,
            max_length=self.config.max_length_tokens, max_batch=self.config.max_batch,
            max_message_bytes=self.config.max_message_bytes, decode_s_per_block=self.stats.decode_s_per_block,
            prefill_a_s=self.stats.prefill_a_s, prefill_b_s=self.stats.prefill_b_s, version=__version__,
        )

    async def expire_loop(self, period_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(period_s)
            for sid in self.sessions.expire(self.config.session_idle_timeout_s):
                self.attached.discard(sid)
                log.info("session %s expired", sid)
