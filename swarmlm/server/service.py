"""The gRPC service: decode and validate what a peer sends, hand compute to the scheduler, encode the reply.

Bad input gets a clear error and changes nothing: steps are fully validated before any compute (shapes and costs
from the message header, before any tensor is decoded), and a session's cache and mask only change when its step
succeeds. Every limit is a ServerConfig setting (docs/FAILURES.md, "Bounded resources"). Refusals of unary calls
are returned, not raised, so no traceback keeps a refused request's buffers alive.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

import grpc
import torch

from swarmlm import __version__
from swarmlm.config import ServerConfig
from swarmlm.errors import CapacityExceeded, InvalidRequest, NotPermitted, PushRefused, UnknownSession
from swarmlm.model.fingerprint import range_fingerprint
from swarmlm.perf.model import ComputeProfile
from swarmlm.server import prefix_cache
from swarmlm.server.checks import StepChecks, check_cache_op, decode_step, payload_bytes, peer_host
from swarmlm.server.prefix_cache import PrefixCache
from swarmlm.server.push import Pusher, StepOrder, TargetCheck, check_targets
from swarmlm.server.scheduler import JobTiming, Scheduler
from swarmlm.server.sessions import PeerBytes, Session, SessionTable
from swarmlm.server.stage import SpanState, Stage
from swarmlm.server.train_service import TrainingRpcs
from swarmlm.server.unary import UNPARSABLE, Admission, UnaryGate, message_of, status_of
from swarmlm.swarm.identity import Identity, sign_info, signed_address
from swarmlm.swarm.private import client_interceptors
from swarmlm.types import CacheOp
from swarmlm.wire import cache_op, codec, compress
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire import swarm_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
_END = object()  # the client half-closed its stream
_BROKEN = object()  # the client's stream broke
_EXPIRED = object()  # the expiry loop closed the session


@dataclass
class ServerStats:
    """What the server announces about itself besides its range."""

    server_id: str = ""
    model: str = ""
    decode_s_per_block: float = 0.0
    prefill_a_s: float = 0.0
    prefill_b_s: float = 0.0
    decode_4rows_s_per_block: float = 0.0  # one decode forward of 4 / 16 rows: compute contention (perf/model.py)
    decode_16rows_s_per_block: float = 0.0


def measured_speeds(profile: ComputeProfile) -> dict[str, float]:
    """A ComputeProfile as the server announces it: ServerStats' speed fields (also the keys of its ready line)."""
    return {"decode_s_per_block": profile.decode_s, "prefill_a_s": profile.prefill_a_s,
            "prefill_b_s": profile.prefill_b_s, "decode_4rows_s_per_block": profile.decode_4rows_s,
            "decode_16rows_s_per_block": profile.decode_16rows_s}


def add_to_server(service: "SwarmService", server) -> None:
    """Register the service like the generated add_SwarmServicer_to_server, except that bytes which do not parse
    reach the handlers as UNPARSABLE and get INVALID_ARGUMENT (gRPC's own deserialization failure is UNKNOWN)."""

    def parse(message_type):
        def parse_or_mark(data: bytes):
            try:
                return message_type.FromString(data)
            except Exception:  # DecodeError, or anything else a hostile byte string provokes
                return UNPARSABLE
        return parse_or_mark

    handlers = {
        "Inference": grpc.stream_stream_rpc_method_handler(
            service.Inference, parse(pb.InferenceRequest), pb.InferenceReply.SerializeToString),
        "Forward": grpc.unary_unary_rpc_method_handler(
            service.Forward, parse(pb.ForwardRequest), pb.ForwardReply.SerializeToString),
        "Backward": grpc.unary_unary_rpc_method_handler(
            service.Backward, parse(pb.BackwardRequest), pb.BackwardReply.SerializeToString),
        "Info": grpc.unary_unary_rpc_method_handler(service.Info, parse(pb.InfoRequest), pb.InfoReply.SerializeToString),
        "Push": grpc.unary_unary_rpc_method_handler(service.Push, parse(pb.PushRequest), pb.PushReply.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("swarmlm.Swarm", handlers),))


class SwarmService(pb_grpc.SwarmServicer):
    def __init__(self, config: ServerConfig, stage: Stage, scheduler: Scheduler, stats: ServerStats) -> None:
        self.config = config
        self.stage = stage  # (and self.checks: what a step may be here)
        self.scheduler = scheduler
        self.stats = stats
        self.prefixes = PrefixCache(min(config.prefix_cache_bytes, config.cache_bytes)) \
            if config.prefix_cache_bytes else None
        self.sessions = SessionTable(config.cache_bytes, config.max_sessions, config.max_sessions_per_peer,
                                     int(config.cache_bytes * config.max_peer_cache_fraction), self.prefixes)
        self.tokens_computed = 0  # rows x tokens run through the blocks (steps and Forwards): the prefill a cache saves
        self.load = PeerBytes(config.max_peer_bytes_in_flight)
        self.attached: set[str] = set()  # sessions held by a live stream
        self.inboxes: dict[str, asyncio.Queue] = {}  # per attached session: its steps, from the stream and pushes
        self.pusher = Pusher(config.max_message_bytes, config.push_timeout_s, client_interceptors(config.swarm_key),
                             config.push_frames, config.swarm_key, max_channels=config.max_push_channels)
        self.identity: Identity | None = None  # set by server.py, with the address it announces
        self.address = ""
        self.relay: Callable[[], str] = lambda: ""  # the relay it is reached through now (server.py; "" = direct)
        self.frame_port = 0  # the framed step port (server/frame_server.py), announced in Info; 0 = none
        # where pushes may go; server.py gives it the DHT's directory when there is a DHT
        self.targets = TargetCheck(None, self.pusher.info, self._serves)
        self._pushes: dict[str, asyncio.Task] = {}  # per session: its latest push (pushes of a session go in order)
        self.accepting = True  # False while draining for shutdown: new sessions go elsewhere
        self.num_model_blocks = int(stage.config.num_hidden_layers)
        self.gate = UnaryGate(self.load, config.trim_refused_bytes)  # every unary RPC's admission (server/unary.py)
        # Forward with prompts / LoRA, and Backward (server/train_service.py)
        self.training = TrainingRpcs(config, scheduler, lambda: self.stage, self.gate.trim)

    @property
    def stage(self) -> Stage:
        return self._stage

    @stage.setter
    def stage(self, stage: Stage) -> None:
        """The blocks served (replaced when the server moves): a step's checks follow them."""
        self._stage = stage
        self.checks = StepChecks(self.config, stage.blocks, stage.hidden_size)

    # ---- validation -------------------------------------------------------------------------------------
    def _adapter(self, asked: str) -> str:
        """The adapter a session opens with: `name` or `name@fingerprint` (then the one held must be that one:
        a client never mixes two versions of one name, server/adapters.py); "" = none."""
        name, _, version = asked.partition("@")
        if asked and name not in self.stage.lora_adapters:
            raise InvalidRequest(f"adapter {asked[:80]!r} is not served here "
                                 f"(served: {', '.join(self.announced_adapters) or 'none'})")
        if version and version != self.stage.adapter_versions[name]:
            raise InvalidRequest(f"adapter {name!r} here is version {self.stage.adapter_versions[name]}, not "
                                 f"{version[:16]!r}")
        return name

    @property
    def announced_adapters(self) -> list[str]:
        """`name@fingerprint` of every adapter held (announced in Info and the record, signed with the Info)."""
        return sorted(f"{n}@{self.stage.adapter_versions[n]}" for n in self.stage.lora_adapters)

    def _open(self, msg: pb.OpenSession, owner: str) -> Session:
        blocks = self.checks.range(msg.start_block, msg.end_block)
        if not 1 <= msg.batch_size <= self.config.max_batch:
            raise InvalidRequest(f"batch_size must be in [1, {self.config.max_batch}], got {msg.batch_size}")
        if not 1 <= msg.max_length <= self.config.max_length_tokens:
            raise InvalidRequest(f"max_length must be in [1, {self.config.max_length_tokens}], got {msg.max_length}")
        adapter = self._adapter(msg.adapter)
        nbytes = self.stage.cache_bytes(blocks.length, msg.batch_size, msg.max_length)
        keys = prefix_cache.check_keys(msg.prefix_keys, "prefix_keys")
        if adapter and (keys or msg.prefix_scope):  # its rows differ from the base model's under the same keys
            raise InvalidRequest("a session with an adapter does not use the prefix cache (no prefix_scope/keys)")
        digest = prefix_cache.check_scope(msg.prefix_scope) if msg.prefix_scope or keys else None
        # no cache allocated until a step
        state = self.stage.new_state(blocks, msg.batch_size, msg.max_length, adapter)
        session = self.sessions.open(owner, state, msg.batch_size, msg.max_length, nbytes)
        session.prefix_digest = digest
        if keys and self.prefixes is not None:
            prefix_cache.start_from_prefix(self.prefixes, self.sessions, session, keys)
        return session

    def _serves(self, info: pb.InfoReply, block: int) -> bool:
        """Does a push target's Info describe a server of this model serving `block`? (no-DHT mode)"""
        return (info.model == self.stats.model and info.num_blocks == self.num_model_blocks
                and info.hidden_size == self.stage.hidden_size and info.start_block <= block < info.end_block)

    # ---- compute ----------------------------------------------------------------------------------------
    async def _compute(self, state: SpanState, hidden: torch.Tensor, mask: torch.Tensor,
                       op: CacheOp | None = None) -> tuple[torch.Tensor, JobTiming]:
        """Run new tokens in slices of at most one scheduler round (max_batch_tokens rows x tokens): a long prefill
        is split, so decode steps of other sessions run between its slices (the scheduler puts decodes first). The
        cache op goes with the first slice."""
        rows, tokens = hidden.shape[:2]
        self.tokens_computed += rows * tokens
        size = max(1, self.config.scheduler.max_batch_tokens // rows)
        outs, queued, compute, batch = [], 0.0, 0.0, 1
        for start in range(0, tokens, size):
            piece = slice(start, start + size)
            out, timing = await self.scheduler.submit_step(
                self.stage, state, hidden[:, piece], mask[:, piece], op if start == 0 else None)
            outs.append(out)
            queued, compute = queued + timing.queued_s, compute + timing.compute_s
            batch = max(batch, timing.batched_steps)
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), JobTiming(queued, compute, batch)

    def _refused_large(self, nbytes: int) -> None:
        if nbytes >= self.config.trim_refused_bytes:
            self.gate.trim()

    # ---- RPCs -------------------------------------------------------------------------------------------
    async def Inference(self, request_iterator, context: grpc.aio.ServicerContext):
        """One session. Its steps come from this stream and from pushes (an inbox merges them); `StepOrder` runs
        each step id once, in order; every reply goes back on this stream."""
        peer = peer_host(context)
        session: Session | None = None
        clean_end = False
        reader: asyncio.Task | None = None
        ended = asyncio.Event()  # the client half-closed its stream
        charges: dict[int, tuple[pb.InferenceRequest, str, int]] = {}  # bytes in flight, per waiting request
        try:
            first = await self._next(request_iterator)
            if first is None:
                return
            if first is UNPARSABLE:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the message does not parse")
            session = await self._attach(first, peer, context)
            sid = session.session_id
            inbox: asyncio.Queue = asyncio.Queue(maxsize=self.config.inbox_steps)
            self.inboxes[sid] = inbox
            if first.WhichOneof("kind") == "step":
                order = StepOrder(self.config.max_steps_ahead, last_id=max(first.step.step_id - 1, 0))
                await self._charge(charges, first, peer, payload_bytes(first.step))
                inbox.put_nowait(first)
            else:
                order = StepOrder(self.config.max_steps_ahead)
                yield pb.InferenceReply(session_id=sid, position=session.state.position,
                                        session_secret=session.secret,  # only ever on the opener's stream
                                        prefix_tokens=session.state.position)
            reader = asyncio.ensure_future(self._read(request_iterator, inbox, ended, peer, charges))
            while True:
                async with asyncio.timeout(self.config.session_idle_timeout_s):  # (wait_for may drop a cancellation)
                    request = await inbox.get()
                if request is _END or request is _BROKEN:
                    clean_end = request is _END
                    return
                if request is UNPARSABLE:
                    yield self._refused(session, 0, InvalidRequest("a message does not parse; it was dropped"))
                    continue
                if request is _EXPIRED:
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                        f"session closed: no step within {self.config.open_idle_timeout_s} s of its "
                                        f"open, or idle for {self.config.session_idle_timeout_s} s")
                if request.WhichOneof("kind") == "save":  # no reply unless refused
                    try:
                        prefix_cache.save_prefix(self.prefixes, self.sessions, session, request.save)
                    except InvalidRequest as exc:
                        yield self._refused(session, 0, exc)
                    continue
                try:
                    ready = order.admit(request)
                except InvalidRequest as exc:
                    ready, refusal = [], self._refused(session, request.step.step_id, exc)
                    self._release(charges, request)
                    yield refusal
                    continue
                if not order.holds(request) and all(step is not request for step in ready):
                    self._release(charges, request)  # the other copy of a step already taken
                for step in ready:
                    reply = await self._step(session, step, context)
                    self._release(charges, step)
                    if reply.pushed:  # before the reply: the next server waits for the push, the client does not
                        self._push_after(sid, reply, step)  # wait for a middle server's reply
                    yield reply
        except asyncio.TimeoutError:
            if session is not None:
                self.sessions.close(session.session_id)
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no message for {self.config.session_idle_timeout_s} s: session closed",
            )
        finally:
            self._end_stream(session, reader, charges, clean_end or ended.is_set())

    def _end_stream(self, session: Session | None, reader: asyncio.Task | None, charges: dict, clean: bool) -> None:
        """A stream ended: its reader stops, its bytes in flight are released, and its session closes (a clean end)
        or waits for its owner to resume it (a broken stream: closed after the resume grace)."""
        if reader is not None:
            reader.cancel()
        for request, owner, nbytes in charges.values():
            self.load.release(owner, nbytes)
        charges.clear()
        if session is not None:
            self.attached.discard(session.session_id)
            self.inboxes.pop(session.session_id, None)
            if clean:
                self.sessions.close(session.session_id)
            else:
                self.sessions.detach(session.session_id)

    async def _charge(self, charges: dict, request: pb.InferenceRequest, peer: str, nbytes: int) -> None:
        await self.load.add(peer, nbytes)
        charges[id(request)] = (request, peer, nbytes)

    def _release(self, charges: dict, request: pb.InferenceRequest) -> None:
        charge = charges.pop(id(request), None)
        if charge is not None:
            self.load.release(charge[1], charge[2])

    async def _read(self, request_iterator, inbox: asyncio.Queue, ended: asyncio.Event, peer: str,
                    charges: dict) -> None:
        """The client's messages into the inbox. A full inbox, or a peer with too many bytes in flight, holds the
        stream back (HTTP/2 flow control)."""
        try:
            async for request in request_iterator:
                if request is not UNPARSABLE and request.WhichOneof("kind") == "step":
                    await self._charge(charges, request, peer, payload_bytes(request.step))
                await inbox.put(request)
        except Exception:  # a broken stream: the session waits for a resume, for the grace only
            await inbox.put(_BROKEN)
            return
        ended.set()  # a clean end, even if the call is cancelled before the handler reads it
        await inbox.put(_END)

    async def Push(self, request: pb.PushRequest, context) -> pb.PushReply:
        return await self.gate.serve(request, context, pb.PushReply(), "push", self._push)

    async def _push(self, request: pb.PushRequest, admission: Admission) -> pb.PushReply:
        """A step pushed by the previous server of a route; accepted only into a session a client's stream holds
        (its reply has to go somewhere), and only with that session's secret. Validated like any step when its turn
        comes."""
        session = self.sessions.sessions.get(request.session_id)
        inbox = self.inboxes.get(request.session_id)
        if session is None or inbox is None:
            raise UnknownSession(f"no stream holds session {request.session_id[:80]!r} here")
        if not session.owned_by(request.secret):
            raise NotPermitted("a push must carry the session's secret")
        if request.step.step_id == 0:
            raise InvalidRequest("a pushed step needs a nonzero step id")
        # counted while it waits for room; once queued, the inbox bound (ServerConfig.inbox_steps) holds it
        admission.charge(payload_bytes(request.step))
        step = pb.InferenceRequest(session_id=request.session_id, step=request.step)
        try:  # a full inbox holds the pusher back, as a full stream holds the client back
            async with asyncio.timeout(self.config.push_room_wait_s):
                await inbox.put(step)
        except asyncio.TimeoutError:
            raise CapacityExceeded("the session has too many steps waiting") from None
        return pb.PushReply()

    async def _next(self, request_iterator) -> pb.InferenceRequest | None:
        try:
            async with asyncio.timeout(self.config.open_idle_timeout_s):
                return await request_iterator.__anext__()
        except StopAsyncIteration:
            return None

    async def _attach(self, first: pb.InferenceRequest, peer: str, context) -> Session:
        kind = first.WhichOneof("kind")
        code, message = None, ""
        try:
            if kind == "open":
                if not self.accepting:
                    raise CapacityExceeded("server is shutting down")
                session = self._open(first.open, peer)
            elif kind == "step" and first.session_id:
                session = self.sessions.get(first.session_id)
                if not session.owned_by(first.secret):
                    raise NotPermitted("resuming a session needs its secret")
                if session.session_id in self.attached:
                    raise InvalidRequest(f"session {first.session_id} is held by another stream")
            else:
                raise InvalidRequest("the first message of a stream must open a session or name an open one")
        except (InvalidRequest, CapacityExceeded, UnknownSession, NotPermitted) as exc:
            code, message = status_of(exc), message_of(exc)
            if isinstance(exc, CapacityExceeded) and not self.accepting:  # draining: this server, not its load
                code = grpc.StatusCode.UNAVAILABLE
        if code is not None:
            await context.abort(code, message)
        session.detached_s = None
        self.attached.add(session.session_id)
        return session

    async def _step(self, session: Session, request: pb.InferenceRequest, context) -> pb.InferenceReply:
        sid = session.session_id
        step_id = request.step.step_id
        started = time.perf_counter()
        error, nbytes = None, 0
        try:
            if request.session_id and request.session_id != sid:
                raise InvalidRequest(f"this stream holds session {sid}, not {request.session_id[:80]}")
            if request.WhichOneof("kind") != "step":
                raise InvalidRequest("a session is already open on this stream: expected a step")
            self.sessions.get(sid)  # refreshes last use; raises if expired meanwhile
            step = request.step
            op = cache_op.from_wire(step, self.config.max_batch)
            past, rows = check_cache_op(op, session.state.position, session.state.rows, session.batch)
            b, t = self.checks.shape(step.hidden, rows, past, session.max_length)
            if b > session.batch:
                raise InvalidRequest(f"hidden: {b} rows exceed the batch of {session.batch} reserved at open")
            nbytes = b * t * self.stage.hidden_size
            if step.push:
                check_targets(step.push)
                nxt = session.state.blocks.end
                if not await self.targets.allowed(step.push[0].address, nxt):
                    raise PushRefused(f"push: {step.push[0].address[:80]!r} is not a server of this swarm "
                                      f"serving block {nxt}")
            hidden, mask = decode_step(step.hidden, step.attention_mask, b, t, self.stage.hidden_size)
        except InvalidRequest as exc:
            error = exc
        except UnknownSession as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
        if error is not None:
            self._refused_large(nbytes)
            return self._refused(session, step_id, error)
        parsed = time.perf_counter()
        if not session.stepped:  # the cache is reserved at the first step, not at open
            try:
                self.sessions.reserve(session)
            except CapacityExceeded as exc:
                error = exc
            if error is not None:
                self.sessions.close(sid)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"session closed: {error}")
        try:  # batched with other sessions' steps of the same shape; decode steps go first
            out, timing = await self._compute(session.state, hidden, mask, op)
        except Exception as exc:  # unexpected (a bug or an OOM): close the session rather than trust it
            log.exception("step failed")
            error = exc
        if error is not None:
            self.sessions.close(sid)
            await context.abort(grpc.StatusCode.INTERNAL, f"step failed, session closed: {error}")
        session.stepped = True
        encode_start = time.perf_counter()
        reply_hidden = compress.encode_like(out, step.hidden.dtype)  # in the request's wire format (wire/compress.py)
        encode_s = time.perf_counter() - encode_start
        return pb.InferenceReply(
            session_id=sid, step_id=step_id, hidden=reply_hidden, position=session.state.position,
            pushed=len(request.step.push) > 0,
            timing=pb.Timing(
                queued_s=timing.queued_s, compute_s=timing.compute_s, parse_s=parsed - started, encode_s=encode_s,
                batched_steps=timing.batched_steps,
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
            if not await self.pusher.push(targets[0], reply.hidden, request.step.attention_mask, targets[1:],
                                          request.step.cache_op if request.step.HasField("cache_op") else None):
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
            error=pb.Error(code="PUSH_REFUSED" if isinstance(exc, PushRefused) else "INVALID_ARGUMENT",
                           message=str(exc)),
        )

    async def Forward(self, request: pb.ForwardRequest, context) -> pb.ForwardReply:
        return await self.gate.serve(request, context, pb.ForwardReply(), "forward", self._forward)

    async def Backward(self, request: pb.BackwardRequest, context) -> pb.BackwardReply:
        """Stateless: a span's input gradient (and its prompts' and LoRA's) from its output gradient."""
        return await self.gate.serve(request, context, pb.BackwardReply(), "backward", self.training.backward)

    async def Info(self, request: pb.InfoRequest, context) -> pb.InfoReply:
        return await self.gate.serve(request, context, pb.InfoReply(), "info", self._info)

    async def _forward(self, request: pb.ForwardRequest, admission: Admission) -> pb.ForwardReply:
        """Stateless: whole sequences through a sub-range, computed in slices through a temporary cache."""
        if codec.is_set(request.prompts) or request.lora:  # training extras: block by block (server/training.py)
            return await self.training.forward(request, admission)
        started = time.perf_counter()
        blocks = self.checks.range(request.start_block, request.end_block)
        b, t = self.checks.shape(request.hidden, None, 0, self.config.max_length_tokens)
        admission.charge(b * t * self.stage.hidden_size)
        hidden, mask = decode_step(request.hidden, request.attention_mask, b, t, self.stage.hidden_size)
        parsed = time.perf_counter()
        out, timing = await self._compute(self.stage.new_state(blocks, b, t), hidden, mask)
        encode_start = time.perf_counter()
        reply = compress.encode_like(out, request.hidden.dtype)  # in the request's wire format
        return pb.ForwardReply(
            hidden=reply,
            timing=pb.Timing(queued_s=timing.queued_s, compute_s=timing.compute_s, parse_s=parsed - started,
                             encode_s=time.perf_counter() - encode_start, batched_steps=timing.batched_steps),
        )

    async def _info(self, request: pb.InfoRequest, admission: Admission) -> pb.InfoReply:
        reply = self.info()
        if self.identity is not None:  # the connect check: sign the client's nonce with our key (swarm/identity.py)
            sign_info(self.identity, reply, request.nonce, signed_address(self.address, self.relay()))
        return reply

    def info(self) -> pb.InfoReply:
        return pb.InfoReply(
            server_id=self.stats.server_id, model=self.stats.model,
            start_block=self.stage.blocks.start, end_block=self.stage.blocks.end,
            num_blocks=self.num_model_blocks, hidden_size=self.stage.hidden_size,
            dtype=str(self.stage.dtype).removeprefix("torch."),  # what "auto" resolved to
            cache_bytes_total=self.sessions.cache_bytes, cache_bytes_free=self.sessions.free_bytes,
            active_sessions=len(self.sessions.sessions), queue_length=self.scheduler.queue_length,
            max_length=self.config.max_length_tokens, max_batch=self.config.max_batch,
            max_message_bytes=self.config.max_message_bytes, decode_s_per_block=self.stats.decode_s_per_block,
            prefill_a_s=self.stats.prefill_a_s, prefill_b_s=self.stats.prefill_b_s, version=__version__,
            decode_4rows_s_per_block=self.stats.decode_4rows_s_per_block,
            decode_16rows_s_per_block=self.stats.decode_16rows_s_per_block,
            session_bytes_per_block_token=self.stage.cache_bytes(1, 1, 1),
            # the weights of the served range, for clients to compare with their own (model/fingerprint.py)
            fingerprint=range_fingerprint(self.config.model_dir, self.stage.blocks.start, self.stage.blocks.end),
            quant=self.stage.announced_quant, weight_bytes=self.stage.weight_bytes,  # int8/int4: announced; bytes held
            adapters=self.announced_adapters,
            prefix_cache=prefix_cache.info(self.prefixes, self.counters_public),
            tokens_computed=self.tokens_computed if self.counters_public else 0,
            frame_port=self.frame_port,
        )

    @property
    def counters_public(self) -> bool:
        """May Info carry per-request counters (ServerConfig.publish_counters)?"""
        return self.config.publish_counters or self.config.swarm_key is not None

    async def expire_loop(self, period_s: float = 0.5) -> None:
        cfg = self.config
        while True:
            await asyncio.sleep(period_s)
            for sid in self.sessions.expire(cfg.session_idle_timeout_s, cfg.open_idle_timeout_s, cfg.resume_grace_s):
                self.attached.discard(sid)
                inbox = self.inboxes.get(sid)
                if inbox is not None:  # its stream ends too (a full inbox: its next step finds no session)
                    try:
                        inbox.put_nowait(_EXPIRED)
                    except asyncio.QueueFull:
                        pass
                log.info("session %s expired", sid)
