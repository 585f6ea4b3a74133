"""The gRPC service: decode and validate what a peer sends, hand compute to the scheduler, encode the reply.
A session's stream and the steps pushed into it are server/session_stream.py's; requests are parsed by
server/inbound.py and unary calls admitted by server/unary.py.

Bad input gets a clear error and changes nothing: steps are fully validated before any compute (shapes and costs
from the message header, before any tensor is decoded), and a session's cache and mask only change when its step
succeeds. Every limit is a ServerConfig setting (docs/FAILURES.md, "Bounded resources"). Refusals of unary calls
are returned, not raised, so no traceback keeps a refused request's buffers alive.
"""
from __future__ import annotations

import functools
import gc
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import grpc
import torch

from swarmlm import __version__
from swarmlm.collector import collection_times
from swarmlm.config import ServerConfig
from swarmlm.errors import CapacityExceeded, InvalidRequest, PushRefused, UnknownSession
from swarmlm.kernels.frame_types import AnswerHead, FrameKey
from swarmlm.model.fingerprint import range_fingerprint
from swarmlm.perf.model import ComputeProfile
from swarmlm.server import deep_prompt, prefix_cache
from swarmlm.server.checks import StepChecks, check_cache_op, decode_step
from swarmlm.server.lane import PushOn, StepLane
from swarmlm.server.prefix_cache import PrefixCache
from swarmlm.server.push import Pusher, StepOrder, TargetCheck, check_targets, kept_route, pushed_in, route_rule
from swarmlm.server.scheduler import JobTiming, Scheduler
from swarmlm.server.session_stream import SessionStreams, refused_reply
from swarmlm.server.sessions import PeerBytes, Session, SessionTable
from swarmlm.server.stage import SpanState, Stage
from swarmlm.server.train_service import TrainingRpcs
from swarmlm.server.unary import Admission, UnaryGate
from swarmlm.small_reads import no_padding_mask
from swarmlm.swarm.identity import Identity, sign_info, signed_address
from swarmlm.swarm.private import client_interceptors
from swarmlm.types import CacheOp
from swarmlm.wire import cache_op, codec, compact, compress
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire import swarm_pb2_grpc as pb_grpc
from swarmlm.wire.compact import AnswerFrame, CompactStep, PushStep
from swarmlm.wire.protocol import PROTOCOL_VERSION
from swarmlm.wire.session_keys import ServerKey

log = logging.getLogger(__name__)


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

    @property
    def profile(self) -> ComputeProfile:
        """The measured speeds as the performance model prices steps with them."""
        return ComputeProfile(self.prefill_a_s, self.prefill_b_s, self.decode_s_per_block,
                              self.decode_4rows_s_per_block, self.decode_16rows_s_per_block)


def measured_speeds(profile: ComputeProfile) -> dict[str, float]:
    """A ComputeProfile as the server announces it: ServerStats' speed fields (also the keys of its ready line)."""
    return {"decode_s_per_block": profile.decode_s, "prefill_a_s": profile.prefill_a_s,
            "prefill_b_s": profile.prefill_b_s, "decode_4rows_s_per_block": profile.decode_4rows_s,
            "decode_16rows_s_per_block": profile.decode_16rows_s}


def gc_info() -> pb.GcInfo:
    """This process's garbage collector as Info reports it (swarmlm/collector.py)."""
    times = collection_times()
    return pb.GcInfo(collections=times.collections, seconds=times.seconds, longest_s=times.longest_s,
                     frozen_objects=gc.get_freeze_count())


def _answers_compact(session: Session, step: pb.InferenceStep, op) -> bool:
    """Is a protobuf step that pushes its output on (its own targets, or its source's kept route) answered by an
    ANSWER? A plain decode step (T = 1, no mask, no cache op, float32, B within u16) of a keyed session: the rule the
    client's `SpanStream._request` applies to such a step."""
    return session.keys is not None and op is None and compact.plain_decode(step.hidden, step.attention_mask)


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
        self.pusher = Pusher(config.max_message_bytes, config.push_timeout_s, client_interceptors(config.swarm_key),
                             config.push_frames, config.swarm_key, max_channels=config.max_push_channels)
        self.identity: Identity | None = None  # set by server.py, with the address it announces
        self.address = ""
        self.relay: Callable[[], str] = lambda: ""  # the relay it is reached through now (server.py; "" = direct)
        self.frame_port = 0  # the framed step port (server/frame_server.py), announced in Info; 0 = none
        # where pushes may go; server.py gives it the DHT's directory when there is a DHT
        self.targets = TargetCheck(None, self.pusher.info, self._serves)
        self.accepting = True  # False while draining for shutdown: new sessions go elsewhere
        self.session_key = ServerKey()  # its share is in our signed Info: sessions keyed end to end with it
        self.streams = SessionStreams(config, self.sessions, self.load, self.pusher, self.prefixes, self._open,
                                      self._step, lambda: self.accepting, self._refused_large,
                                      self.session_key,
                                      self.lane_for if config.step_lane else None)  # (session_stream.py)
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
        prompts = deep_prompt.decode_prompts(msg.prompts, blocks, msg.max_length, self.stage.hidden_size)
        lora = self.training.decode_lora(msg.lora, blocks)  # a client's own, held by the session
        nbytes = self.stage.cache_bytes(blocks.length, msg.batch_size, msg.max_length) \
            + deep_prompt.prompt_bytes(prompts, torch.float32) + sum(4 * (d.a.numel() + d.b.numel()) for d in lora)
        keys = prefix_cache.check_keys(msg.prefix_keys, "prefix_keys")
        if (adapter or prompts is not None or lora) and (keys or msg.prefix_scope):  # rows unlike the base's
            raise InvalidRequest("a session with an adapter, a deep prompt or a LoRA does not use the prefix "
                                 "cache (no prefix_scope/keys)")
        digest = prefix_cache.check_scope(msg.prefix_scope) if msg.prefix_scope or keys else None
        # no cache allocated until a step
        state = self.stage.new_state(blocks, msg.batch_size, msg.max_length, adapter, prompts, lora)
        # its first step comes after the blocks before its span have run its prompt (at most max_length tokens)
        upstream_s = self.stats.profile.step_s(blocks.start, msg.batch_size, msg.max_length, cached=False)
        session = self.sessions.open(owner, state, msg.batch_size, msg.max_length, nbytes,
                                     open_idle_s=self.config.open_idle_limit_s(upstream_s))
        session.prefix_digest = digest
        if keys and self.prefixes is not None:
            prefix_cache.start_from_prefix(self.prefixes, self.sessions, session, keys)
        return session

    def _serves(self, info: pb.InfoReply, block: int) -> bool:
        """Does a push target's Info describe a server of this model serving `block`? (no-DHT mode)"""
        return (info.model == self.stats.model and info.num_blocks == self.num_model_blocks
                and info.hidden_size == self.stage.hidden_size and info.start_block <= block < info.end_block)

    # ---- compute ----------------------------------------------------------------------------------------
    def _compute(self, state: SpanState, hidden: torch.Tensor, mask: torch.Tensor,
                 op: CacheOp | None = None) -> Awaitable[tuple[torch.Tensor, JobTiming]]:
        """Run new tokens in slices of at most one scheduler round (max_batch_tokens rows x tokens): a long prefill
        is split, so decode steps of other sessions run between its slices (the scheduler puts decodes first). The
        cache op goes with the first slice. (Await the result.)"""
        rows, n_tokens = hidden.shape[:2]
        self.tokens_computed += rows * n_tokens
        size = max(1, self.config.scheduler.max_batch_tokens // rows)
        if n_tokens <= size:  # one slice (every decode step): the tensors themselves, no view made (each torch call
            # costs ~20 us cold), and the scheduler's own coroutine: no frame of ours in between to resume
            return self.scheduler.submit_step(self._stage, state, hidden, mask, op)
        return self._compute_slices(state, hidden, mask, op, size)

    async def _compute_slices(self, state: SpanState, hidden: torch.Tensor, mask: torch.Tensor, op: CacheOp | None,
                              size: int) -> tuple[torch.Tensor, JobTiming]:
        n_tokens = hidden.shape[1]
        outs, queued, compute, batch = [], 0.0, 0.0, 1
        for start in range(0, n_tokens, size):
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

    async def _step(self, session: Session, request: pb.InferenceRequest | CompactStep,
                    context) -> pb.InferenceReply | AnswerFrame:
        """One step of a session: an InferenceRequest's, answered by an InferenceReply, or a compact STEP's (or a
        PUSH_STEP's; wire/compact.py: no cache op, no mask, no push), answered by an ANSWER frame (a refusal by a
        reply; on a gRPC stream, which only a pushed one reaches, by a reply too)."""
        sid = session.session_id
        compact_step = type(request) is CompactStep
        step = request.step
        step_id = step.step_id
        started = time.perf_counter()
        error, nbytes = None, 0
        from_push = pushed_in(request)
        # pushed on (its own targets, or a route its source kept: server/push.py) and its source's route after it
        route = kept_route(session, from_push)
        pushes_on = compact_step and route is not None
        try:
            if request.session_id and request.session_id != sid:
                raise InvalidRequest(f"this stream holds session {sid}, not {request.session_id[:80]}")
            if request.WhichOneof("kind") != "step":
                raise InvalidRequest("a session is already open on this stream: expected a step")
            if compact_step and session.keys is None:  # (its MAC is the session's client key's)
                raise InvalidRequest("a compact STEP needs a keyed session")
            self.sessions.get(sid)  # refreshes last use; raises if expired meanwhile
            op = None if compact_step else cache_op.from_wire(step, self.config.max_batch)
            past, rows = check_cache_op(op, session.state.position, session.state.rows, session.batch)
            if compact_step:
                b, t = self.checks.dims(step.b, step.t, step.h, rows, past, session.max_length)
            else:
                b, t = self.checks.shape(step.hidden, rows, past, session.max_length)
            if b > session.batch:
                raise InvalidRequest(f"hidden: {b} rows exceed the batch of {session.batch} reserved at open")
            hidden_size = self.checks.hidden_size
            nbytes = b * t * hidden_size
            if compact_step:
                if t == 1 and session.framed and session.stepped and self.config.one_call_steps:
                    step.check_length()
                    answer = self._answer_in_one_call(session, step, b, started, pushes_on)  # None: as below
                    if answer is not None:
                        if type(answer) is AnswerFrame:
                            return answer
                        await self._step_failed(sid, answer, context)
                hidden = codec.tensor_of(step.values(), (b, t, hidden_size), "hidden", finite=True)
                mask = no_padding_mask(b, t)
            else:
                if step.push:
                    check_targets(step.push)
                    nxt = session.state.blocks.end
                    if not await self.targets.allowed(step.push[0].address, nxt):
                        raise PushRefused(f"push: {step.push[0].address[:80]!r} is not a server of this swarm "
                                          f"serving block {nxt}")
                pushes_on, route = route_rule(session, step, op, from_push)
                hidden, mask = decode_step(step.hidden, step.attention_mask, b, t, hidden_size)
        except InvalidRequest as exc:
            error = exc
        except UnknownSession as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
        if error is not None:
            self._refused_large(nbytes)
            return refused_reply(session, step_id, error)
        if from_push:  # (taken: its source's route is the rule's, kept, replaced or dropped)
            session.push_route = route
        else:
            session.stream_route = route
        parsed = time.perf_counter()
        if not session.stepped:  # the cache is reserved at the first step, not at open
            try:
                self.sessions.reserve(session)
            except CapacityExceeded as exc:
                error = exc
            if error is not None:
                self.sessions.close(sid)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"session closed: {error}")
            session.stepped = True  # admitted: a long first step does not count against its open_idle_s
        try:  # batched with other sessions' steps of the same shape; decode steps go first
            out, timing = await self._compute(session.state, hidden, mask, op)
        except Exception as exc:  # unexpected (a bug or an OOM): close the session rather than trust it
            log.exception("step failed")
            error = exc
        if error is not None:
            await self._step_failed(sid, error, context)
        session.last_used_s = time.monotonic()  # idle from the step's end: a long step is no idle time
        encode_start = time.perf_counter()
        # a STEP's, a PUSH_STEP's (in a session held by a gRPC stream: a REPLY) or a pushing plain decode step's answer
        # is an ANSWER, the latter flagged and keeping its output for the push (the client takes an ANSWER for such a
        # step: client/streams.py `_request`, `expect`)
        if session.framed and (compact_step or pushes_on and _answers_compact(session, step, op)):
            return compact.answer_frame(
                session.keys.server, sid, step_id, session.state.position, compact.float32_values(out),
                timing.queued_s, timing.compute_s, parsed - started, time.perf_counter() - encode_start,
                timing.batched_steps, pushed_dims=tuple(out.shape) if pushes_on else None)
        # in the request's wire format (wire/compress.py); a compact step's is float32
        reply_hidden = compress.encode_like(out, "float32" if compact_step else step.hidden.dtype)
        encode_s = time.perf_counter() - encode_start
        return pb.InferenceReply(
            session_id=sid, step_id=step_id, hidden=reply_hidden, position=session.state.position,
            pushed=pushes_on,
            timing=pb.Timing(
                queued_s=timing.queued_s, compute_s=timing.compute_s, parse_s=parsed - started, encode_s=encode_s,
                batched_steps=timing.batched_steps,
            ),
        )

    async def _step_failed(self, sid: str, error: Exception, context) -> None:
        """A step's compute failed unexpectedly (a bug or an OOM; logged): its session is closed rather than
        trusted, and the stream ends with the error."""
        self.sessions.close(sid)
        await context.abort(grpc.StatusCode.INTERNAL, f"step failed, session closed: {error}")

    def _answer_in_one_call(self, session: Session, step: CompactStep, b: int, started: float,
                            pushes_on: bool = False) -> AnswerFrame | Exception | None:
        """A compact STEP of a framed session (T = 1, its dims and length checked) answered in one kernel call
        (kernels/lane.c: values checked finite, the span, the whole ANSWER frame) when that computes exactly what
        `_compute` and `answer_frame` would: a span the one-call decoder runs (Stage.plain_decoder) and a step the
        scheduler would run inline on this thread (Scheduler.inline_slot: no other session's step to batch with).
        Returns the ANSWER, None when the step must go the usual way (nothing done), or the exception of a failed
        compute (logged); raises InvalidRequest (nothing computed, nothing committed) for a NaN or infinite value.
        `pushes_on`: the step goes on its source's kept route (the ANSWER flagged, its output kept for the push)."""
        state = session.state
        decoder = self._stage.plain_decoder(state, b)
        if decoder is None:
            return None
        member = id(state)  # (the scheduler's member for this session's steps: Scheduler.submit_step)
        if not self.scheduler.inline_slot(member):
            return None
        key = session.answer_key
        if key is None:
            key = session.answer_key = FrameKey.of(session.keys.server, session.session_id)
        head = AnswerHead(step.step_id, state.position + 1, 1, compact.PUSHED if pushes_on else 0, 0.0, 0.0,
                          time.perf_counter() - started, 0.0)
        body = step.body if type(step.body) is bytes else bytes(step.body)  # (a PUSH_STEP's is a view of its frame)
        frame, ran = None, True
        try:
            frame = self._stage.answer_step(decoder, state, body, b, key, head)
            ran = frame is not None  # (None: refused before any compute, not counted)
        except Exception as exc:  # unexpected (a bug or an OOM): as `_step`'s compute failure
            log.exception("step failed")
            return exc
        finally:
            self.scheduler.inline_done(member, head.compute_s if ran else None)
        if frame is None:
            raise codec.not_finite("hidden")
        self.tokens_computed += b
        session.last_used_s = time.monotonic()  # idle from the step's end
        answer = AnswerFrame(frame)
        if pushes_on:
            answer.pushed, answer.output = True, (compact.answer_values(answer), (b, 1, self.checks.hidden_size))
        return answer

    def lane_tokens(self) -> int:
        """Rows x tokens the armed step lane computed so far (added to `tokens_computed` when it is disarmed)."""
        lane = self.scheduler.lane
        return lane.rows * lane.steps if lane is not None else 0

    def lane_for(self, session: Session, order: StepOrder, reads_pushes: bool = False) -> StepLane | None:
        """A step lane for the session's next plain decode steps (server/lane.py), or None unless every rule `_step`
        applies to them holds whatever they carry, until something disarms the lane: a keyed session alone on this
        server (a second open disarms it), no adapter or deep prompt, its rows within the session's, its dims within
        every limit up to its max_length; its span a one-call decoder's with a rotary table (the whole step in C), or
        else blocks whose decode forwards run inline on the loop (`Scheduler.decodes_inline`: the same thread)."""
        state = session.state
        rows, max_length = state.rows, session.max_length
        scheduler = self.scheduler
        if len(self.sessions.sessions) != 1 or not 0 < state.position < max_length or not scheduler.idle:
            return None  # (for now: a lane armed beside other compute would only be disarmed by its next step)
        decoder = self._stage.plain_decoder(state, rows)
        if decoder is not None and (not decoder.has_rope_table or state.cache.dtype != decoder.kv_dtype):
            decoder = None  # (transformers' forward, as the usual path would run it)
        if (session.keys is None or state.lora_adapter or state.client_lora or state.prompts is not None
                or not 0 < rows <= session.batch):
            session.lane_never = True  # (for good: none of these changes during a session; rows only with a cache op)
            return None
        try:  # (the costs grow with the position: what holds at the last one holds at every one before it)
            self.checks.dims(rows, 1, self.checks.hidden_size, rows, max_length - 1, max_length)
        except InvalidRequest:
            session.lane_never = True
            return None
        route = kept_route(session, reads_pushes)
        if decoder is None and not scheduler.decodes_inline:
            return None  # (for now: its forwards go to the compute thread)
        push_on = None
        if route is not None:  # (its steps go on: the next session's push key, and a push connection of its own)
            target = route.target
            key = session.push_key(target.session_id, target.push_key)
            framed = self.pusher.framed
            if key is None or framed is None or not framed.known_port(target.address):
                return None
            conn = framed.idle(target.address)
            if conn is None:
                return None
            if conn.transport.get_write_buffer_size():  # (the thread writes the socket itself: nothing may be queued)
                framed.keep(target.address, conn)
                return None
            push_on = PushOn(route, key, conn)
        return StepLane(self, session, order, decoder, push_on, reads_pushes)

    # ---- RPCs -------------------------------------------------------------------------------------------
    @property
    def Inference(self):
        """One session's stream: SessionStreams.serve (server/session_stream.py), an async generator function as
        gRPC's handler registration expects."""
        return self.streams.serve

    async def Push(self, request: pb.PushRequest | PushStep, context, data: bytes | None = None) -> pb.PushReply:
        """`data`: the bytes `request` was parsed from (the framed port has them: its MAC is checked on them). A
        framed port's compact PUSH_STEP (wire/compact.py) comes as a `PushStep`."""
        handle = self.streams.push if data is None else functools.partial(self.streams.push, data=data)
        return await self.gate.serve(request, context, pb.PushReply(), "push", handle)

    def push_now(self, request: pb.PushRequest | PushStep, data: bytes | None, context) -> pb.PushReply | None:
        """`Push` of a framed push (a PUSH's request and the bytes it was parsed from, or a PUSH_STEP's `PushStep`)
        if it is taken without waiting (its status on `context`, refusals included); None when it would wait for
        room (nothing done: then `Push` it)."""
        return self.gate.serve_now(request, context, pb.PushReply(), "push",
                                   functools.partial(self.streams.push_now, data=data))

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
            key_share=self.session_key.share,  # (signed with the rest: clients key their sessions with it)
            server_id=self.stats.server_id, model=self.stats.model,
            start_block=self.stage.blocks.start, end_block=self.stage.blocks.end,
            num_blocks=self.num_model_blocks, hidden_size=self.stage.hidden_size,
            dtype=str(self.stage.dtype).removeprefix("torch."),  # what "auto" resolved to
            kv_dtype=str(self.stage.kv_dtype).removeprefix("torch."),  # (float16 beside float32 blocks: K/V rounded)
            cache_bytes_total=self.sessions.cache_bytes, cache_bytes_free=self.sessions.free_bytes,
            active_sessions=len(self.sessions.sessions), queue_length=self.scheduler.queue_length,
            max_length=self.config.max_length_tokens, max_batch=self.config.max_batch,
            max_message_bytes=self.config.max_message_bytes, decode_s_per_block=self.stats.decode_s_per_block,
            prefill_a_s=self.stats.prefill_a_s, prefill_b_s=self.stats.prefill_b_s, version=__version__,
            protocol=PROTOCOL_VERSION,  # (clients refuse another: wire/protocol.py)
            decode_4rows_s_per_block=self.stats.decode_4rows_s_per_block,
            decode_16rows_s_per_block=self.stats.decode_16rows_s_per_block,
            session_bytes_per_block_token=self.stage.cache_bytes(1, 1, 1),
            # the weights of the served range, for clients to compare with their own (model/fingerprint.py)
            fingerprint=range_fingerprint(self.config.model_dir, self.stage.blocks.start, self.stage.blocks.end),
            quant=self.stage.announced_quant, weight_bytes=self.stage.weight_bytes,  # int8/int4: announced; bytes held
            adapters=self.announced_adapters,
            prefix_cache=prefix_cache.info(self.prefixes, self.counters_public),
            tokens_computed=self.tokens_computed + self.lane_tokens() if self.counters_public else 0,
            gc=gc_info() if self.counters_public else None,  # (its pauses time the requests it served)
            frame_port=self.frame_port,
        )

    @property
    def counters_public(self) -> bool:
        """May Info carry per-request counters (ServerConfig.publish_counters)?"""
        return self.config.publish_counters or self.config.swarm_key is not None
