"""A session's Inference stream and the steps pushed into it (server/push.py sends them; this side takes them).

A stream opens a session (or resumes one with its secret), then its steps, from the stream and from pushes, meet in
one inbox; `StepOrder` runs each step id once, in order, and every reply goes back on the stream. A full inbox, or a
peer with too many bytes in flight, holds the stream (or the pusher) back. What a step may be and how it is
computed is the service's (server/service.py: `open_session`, `run_step`); this module moves steps and replies.
The framed port (server/frame_server.py) serves the same handlers.

A keyed session (wire/session_keys.py) takes no message whose MAC does not match: a bad open, resume or push is
refused, a bad message on the stream ends the stream and the session (PERMISSION_DENIED: someone on the way changed
it); every reply carries the server's MAC.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Awaitable, Callable

import grpc

from swarmlm.config import ServerConfig
from swarmlm.errors import CapacityExceeded, InvalidRequest, NotPermitted, PushRefused, UnknownSession
from swarmlm.server import prefix_cache
from swarmlm.server.checks import payload_bytes, peer_host
from swarmlm.server.inbound import UNPARSABLE
from swarmlm.server.inbox import Inbox
from swarmlm.server.lane import StepLane
from swarmlm.server.prefix_cache import PrefixCache
from swarmlm.server.push import Pusher, PushedStep, StepOrder, kept_route, pushed_in
from swarmlm.server.sessions import PeerBytes, Session, SessionTable
from swarmlm.server.unary import Admission, message_of, status_of
from swarmlm.wire import session_keys
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire.compact import AnswerFrame, CompactStep, PushStep

log = logging.getLogger(__name__)

_NO_MASK = pb.Tensor()  # (a pushed step's mask when it has none: all ones)
_END = object()  # the client half-closed its stream
_BROKEN = object()  # the client's stream broke
_EXPIRED = object()  # the expiry loop closed the session
_TAMPERED = object()  # a message of a keyed session whose MAC does not match

OpenSession = Callable[[pb.OpenSession, str], Session]  # (the open message, its peer) -> the new session
RunStep = Callable[[Session, pb.InferenceRequest, object], Awaitable[pb.InferenceReply]]  # (..., grpc context)
LaneFor = Callable[[Session, StepOrder], "StepLane | None"]  # (the session, its step order) -> a lane or None


def _via(step):
    """The push connection a step came by (a PUSH_STEP's, on the framed port), or None (the stream's own)."""
    return step.via if type(step) is CompactStep else None


def refused_reply(session: Session, step_id: int, exc: Exception) -> pb.InferenceReply:
    """A refused step's reply: the session is unchanged and stays usable."""
    return pb.InferenceReply(
        session_id=session.session_id, step_id=step_id, position=session.state.position,
        error=pb.Error(code="PUSH_REFUSED" if isinstance(exc, PushRefused) else "INVALID_ARGUMENT",
                       message=str(exc)),
    )


def _sealed(session: Session, reply: pb.InferenceReply) -> bytes:
    """A reply as the stream sends it: serialized, with the server's MAC when the session is keyed (serialized once:
    each protobuf call costs ~10x its warm time right after a forward, docs/RESULTS-hop.md round 11)."""
    if type(reply) is AnswerFrame:  # a compact STEP's answer: a whole frame, MACed (wire/compact.py)
        return reply
    if session.keys is None:
        return reply.SerializeToString()
    return session_keys.signed_bytes(session.keys.server, session.session_id, reply)


def _checked(session: Session, request, data: bytes | None = None):
    """A message from the session's stream, or `_TAMPERED` if the session is keyed and its MAC does not match.
    `data`: the bytes it was parsed from, when the transport has them (framed): the MAC is checked on them."""
    if session.keys is None or request is UNPARSABLE:
        return request  # (a compact STEP of an unkeyed session is refused by its step)
    keys, sid = session.keys, session.session_id
    if type(request) is CompactStep:
        return request if request.verified(keys.client, sid) else _TAMPERED
    ok = session_keys.verified(keys.client, sid, request) if data is None else \
        session_keys.verified_bytes(keys.client, sid, request, data)
    return request if ok else _TAMPERED


class SessionStreams:
    """The streams of a server's sessions: the ones held now (`attached`), their inboxes, their pushes on."""

    def __init__(self, config: ServerConfig, sessions: SessionTable, load: PeerBytes, pusher: Pusher,
                 prefixes: PrefixCache | None, open_session: OpenSession, run_step: RunStep,
                 accepting: Callable[[], bool], refused_open: Callable[[int], None],
                 server_key: session_keys.ServerKey, lane_for: LaneFor | None = None) -> None:
        self.config, self.sessions, self.load, self.pusher, self.prefixes = config, sessions, load, pusher, prefixes
        self.open_session, self.run_step, self.accepting = open_session, run_step, accepting
        self.refused_open = refused_open  # (its message's bytes): a refused open of many MB gives its memory back
        self.server_key = server_key  # keys the sessions opened with a key share
        self.attached: set[str] = set()  # sessions held by a live stream
        self.inboxes: dict[str, Inbox] = {}  # per attached session: its steps, from the stream and pushes
        self._pushes: dict[str, asyncio.Task] = {}  # per session: its latest push (pushes of a session go in order)
        self.lane_for = lane_for  # a session's step lane, if the usual path's rules allow one (server/lane.py)
        self.lanes: dict[str, StepLane] = {}  # armed lanes by session (a lane disarmed by its connection may linger)
        sessions.changing = self._sessions_changing

    async def serve(self, request_iterator, context: grpc.aio.ServicerContext):
        """One session. Its steps come from this stream and from pushes (an inbox merges them); `StepOrder` runs
        each step id once, in order; every reply goes back on this stream, serialized (`_sealed`)."""
        peer = peer_host(context)
        framed = hasattr(request_iterator, "feed")  # the framed port's stream (server/frame_server.py)
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
            if type(first) is CompactStep:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    "a compact STEP before a session is open: the first message must open or resume")
            session = await self._attach(first, peer, context)
            session.framed = framed
            sid = session.session_id
            inbox = Inbox(self.config.inbox_steps)
            self.inboxes[sid] = inbox
            if first.WhichOneof("kind") == "step":
                order = StepOrder(self.config.max_steps_ahead, last_id=max(first.step.step_id - 1, 0))
                await self._charge(charges, first, peer, payload_bytes(first.step))
                inbox.put_nowait(first)
            else:
                order = StepOrder(self.config.max_steps_ahead)
                yield _sealed(session, pb.InferenceReply(
                    session_id=sid, position=session.state.position,
                    session_secret=session.secret,  # only ever on the opener's stream
                    prefix_tokens=session.state.position))
            reader = asyncio.ensure_future(self._read(request_iterator, inbox, ended, peer, charges, session))
            while True:
                request = await self._next_in(inbox, session)
                if request is _END or request is _BROKEN:
                    clean_end = request is _END
                    return
                if request is UNPARSABLE:
                    yield _sealed(session, refused_reply(session, 0, InvalidRequest(
                        "a message does not parse; it was dropped")))
                    continue
                if request is _TAMPERED:
                    self.sessions.close(sid)
                    await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"a message's {session_keys.TAMPERED} "
                                        "(changed on the way): session closed")
                if request is _EXPIRED:
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                        f"session closed: no step within {session.open_idle_s:.0f} s of its "
                                        f"open, or idle for {self.config.session_idle_timeout_s} s")
                if request.WhichOneof("kind") == "save":  # no reply unless refused
                    try:
                        prefix_cache.save_prefix(self.prefixes, self.sessions, session, request.save)
                    except InvalidRequest as exc:
                        yield _sealed(session, refused_reply(session, 0, exc))
                    continue
                try:
                    ready = order.admit(request)
                except InvalidRequest as exc:
                    ready, refusal = [], refused_reply(session, request.step.step_id, exc)
                    self._release(charges, request)
                    yield _sealed(session, refusal)
                    continue
                if not (ready and ready[0] is request) and not order.holds(request):  # (admit: it comes first)
                    self._release(charges, request)  # the other copy of a step already taken
                for step in ready:
                    reply = await self.run_step(session, step, context)
                    self._release(charges, step)
                    if reply.pushed and framed:
                        # the reply before the push (the framed port writes a reply as it is yielded and asks for
                        # the next one at once): the push wakes the next server, which can take this server's CPU
                        # before it writes anything more, and the client needs this reply to end the step
                        # (docs/RESULTS-hop.md round 17). A client not reading its replies holds its own pushes back
                        yield _sealed(session, reply)
                        if self._push_after(session, reply, step) and type(reply) is AnswerFrame:
                            self._arm(session, order, inbox, charges, request_iterator.conn, step)
                        continue
                    if reply.pushed and not self._push_after(session, reply, step):
                        # gRPC: the push before the reply (a reply yielded may wait in gRPC's writer for a while):
                        # the next server waits for the push, while the client sleeps until the route's last reply,
                        # not this middle one (a push not written at once is a task: yielding once lets it write)
                        await asyncio.sleep(0)
                    yield _sealed(session, reply)
                    if type(reply) is AnswerFrame and framed:  # (the next steps may take the lane)
                        self._arm(session, order, inbox, charges, request_iterator.conn, step)
        except asyncio.TimeoutError:
            if session is not None:
                self.sessions.close(session.session_id)
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no message for {self.config.session_idle_timeout_s} s: session closed",
            )
        finally:
            self._end_stream(session, reader, charges, clean_end or ended.is_set())

    async def _next_in(self, inbox: Inbox, session: Session):
        """The session's next message; asyncio.TimeoutError after session_idle_timeout_s without one, unless its
        step lane took steps meanwhile (they never pass the inbox)."""
        timeout_s = self.config.session_idle_timeout_s
        while True:
            try:
                return await inbox.get(timeout_s)
            except asyncio.TimeoutError:
                lane = self.lanes.get(session.session_id)
                if lane is None or not lane.armed or time.monotonic() - session.last_active_s() >= timeout_s:
                    raise

    def _arm(self, session: Session, order: StepOrder, inbox: Inbox, charges: dict, conn, step) -> None:
        """A step lane for the session's next plain decode steps, after `step` was answered: on the session's
        connection `conn` for a step of its stream, on the push connection a PUSH_STEP came by (answering on `conn`)
        for one of a push; none after a push that came otherwise (a PUSH, gRPC: the next step comes by push again,
        and would disarm a lane on the stream at once, a thread started and joined per step). When nothing is
        waiting anywhere for the session (inbox, step order, bytes in flight, a push on its way out, the
        connections' bytes) and the service allows one (server/lane.py)."""
        sid = session.session_id
        via = _via(step)
        if via is None and pushed_in(step):
            return
        reads = conn if via is None else via
        if (self.lane_for is None or session.lane_never or not reads.may_arm() or not inbox.empty() or not order.idle
                or charges or sid in self._pushes or via is not None and not conn.may_answer()):
            return
        lane = self.lane_for(session, order, reads_pushes=via is not None)
        if lane is not None:
            self.lanes[sid] = lane
            reads.arm(lane, None if via is None else conn)

    def disarm(self, session_id: str | None = None) -> None:
        """The step lane of `session_id` (None: every lane) back to the usual path, its state written back."""
        for sid in [session_id] if session_id is not None else list(self.lanes):
            lane = self.lanes.pop(sid, None)
            if lane is not None:
                lane.disarm()

    def _sessions_changing(self, session_id: str | None) -> None:
        self.disarm(session_id)  # (an open: every lane, its session no longer alone; a close or detach: its own)

    def _end_stream(self, session: Session | None, reader: asyncio.Task | None, charges: dict, clean: bool) -> None:
        """A stream ended: its reader stops, its bytes in flight are released, and its session closes (a clean end)
        or waits for its owner to resume it (a broken stream: closed after the resume grace)."""
        if reader is not None:
            reader.cancel()
        if session is not None:
            self.disarm(session.session_id)
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

    async def _read(self, request_iterator, inbox: Inbox, ended: asyncio.Event, peer: str,
                    charges: dict, session: Session) -> None:
        """The client's messages into the inbox. A full inbox, or a peer with too many bytes in flight, holds the
        stream back (HTTP/2 flow control). A framed stream puts each message in as its frame arrives (`feed`,
        server/frame_server.py: no task between the socket and the step)."""
        try:
            feed = getattr(request_iterator, "feed", None)
            if feed is not None:
                await feed(functools.partial(self._take_now, inbox, peer, charges, session),
                           lambda request, data: self._take(inbox, peer, charges, session,
                                                            _checked(session, request, data)))
            else:
                async for request in request_iterator:
                    await self._take(inbox, peer, charges, session, _checked(session, request))
        except Exception:  # a broken stream: the session waits for a resume, for the grace only
            await inbox.put(_BROKEN)
            return
        ended.set()  # a clean end, even if the call is cancelled before the handler reads it
        await inbox.put(_END)

    async def _take(self, inbox: Inbox, peer: str, charges: dict, session: Session, request) -> None:
        """One message of the client into its session's inbox, waiting for room (its step's bytes, then the inbox)."""
        self._stream_speaks(session)
        if request is not UNPARSABLE and request is not _TAMPERED and request.WhichOneof("kind") == "step":
            await self._charge(charges, request, peer, payload_bytes(request.step))
        await inbox.put(request)

    def _take_now(self, inbox: Inbox, peer: str, charges: dict, session: Session, request, data: bytes) -> bool:
        """`_take` of a framed request (its MAC checked on `data`) if there is room now; False (nothing done) if it
        would have to wait."""
        if inbox.full():
            return False
        self._stream_speaks(session)
        request = _checked(session, request, data)
        if request is not UNPARSABLE and request is not _TAMPERED and request.WhichOneof("kind") == "step":
            nbytes = payload_bytes(request.step)
            if not self.load.try_add(peer, nbytes):
                return False
            charges[id(request)] = (request, peer, nbytes)
        inbox.put_nowait(request)
        return True

    def _stream_speaks(self, session: Session) -> None:
        """A message on a session's stream: a lane that reads its pushes (not this stream) is disarmed first, as a
        push disarms one that reads the stream."""
        lane = self.lanes.get(session.session_id)
        if lane is not None and lane.reads_pushes:
            self.disarm(session.session_id)

    async def push(self, request: pb.PushRequest, admission: Admission, data: bytes | None = None) -> pb.PushReply:
        """A step pushed by the previous server of a route (`_pushed_step` checks it), into its session's inbox; a
        full inbox holds the pusher back, as a full stream holds the client back. `data`: the bytes it was parsed
        from, when the transport has them (framed): its MAC is checked on them."""
        inbox, step = self._pushed_step(request, admission, data)
        if not inbox.full():  # (room now: no timeout to arm)
            inbox.put_nowait(step)
            return pb.PushReply()
        try:
            async with asyncio.timeout(self.config.push_room_wait_s):
                await inbox.put(step)
        except asyncio.TimeoutError:
            raise CapacityExceeded("the session has too many steps waiting") from None
        return pb.PushReply()

    def push_now(self, request: pb.PushRequest | PushStep, admission: Admission,
                 data: bytes | None) -> pb.PushReply | None:
        """`push` if its session's inbox has room now; None (nothing checked, nothing queued) if it would have to
        wait: `push` then checks it once, where it waits."""
        inbox = self.inboxes.get(request.session_id)
        if inbox is not None and inbox.full():
            return None
        inbox, step = self._pushed_step(request, admission, data)
        inbox.put_nowait(step)
        return pb.PushReply()

    def _pushed_step(self, request: pb.PushRequest | PushStep, admission: Admission,
                     data: bytes | None) -> tuple[Inbox, PushedStep | CompactStep]:
        """A pushed step's session inbox and the step, or the refusal: accepted only into a session a client's
        stream holds (its reply has to go somewhere), only with that session's secret (and its push key's MAC if
        keyed: on `data`, the bytes it was parsed from, when given: `verified_bytes`, no re-serialization). Its
        bytes are charged to the pusher (`admission`) while it waits for room; once queued, the inbox bound
        (ServerConfig.inbox_steps) holds it. Validated like any step when its turn comes. A compact PUSH_STEP
        (wire/compact.py: keyed sessions only) goes in as its `CompactStep`, a PushRequest as a `PushedStep` (both say
        they were pushed: the source of a kept route)."""
        compact_push = type(request) is PushStep
        session = self.sessions.sessions.get(request.session_id)
        inbox = self.inboxes.get(request.session_id)
        if session is None or inbox is None:
            raise UnknownSession(f"no stream holds session {request.session_id[:80]!r} here")
        if not session.owned_by(request.secret):
            raise NotPermitted("a push must carry the session's secret")
        keys = session.keys
        if compact_push:
            if keys is None or not request.verified(keys.push):
                raise NotPermitted("a PUSH_STEP must carry its keyed session's push key MAC (missing or wrong)")
        elif keys is not None and not (
                session_keys.verified(keys.push, session.session_id, request) if data is None else
                session_keys.verified_bytes(keys.push, session.session_id, request, data)):
            raise NotPermitted("a push into a keyed session must carry its push key's MAC (missing or wrong)")
        self.disarm(session.session_id)  # (a push: the session's steps come another way now)
        step = request.step  # (a PUSH_STEP's: its STEP part, a `CompactStep`)
        if step.step_id == 0:
            raise InvalidRequest("a pushed step needs a nonzero step id")
        admission.charge(payload_bytes(step))
        return inbox, step if compact_push else PushedStep(request.session_id, step)

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
                if not self.accepting():
                    raise CapacityExceeded("server is shutting down")
                keys = self._open_keys(first)
                session = self.open_session(first.open, peer)
                session.keys = keys
            elif kind == "step" and first.session_id:
                session = self.sessions.get(first.session_id)
                if not session.owned_by(first.secret):
                    raise NotPermitted("resuming a session needs its secret")
                if _checked(session, first) is _TAMPERED:
                    raise NotPermitted(f"resume: its {session_keys.TAMPERED} (missing or changed)")
                if session.session_id in self.attached:
                    raise InvalidRequest(f"session {first.session_id} is held by another stream")
            else:
                raise InvalidRequest("the first message of a stream must open a session or name an open one")
        except (InvalidRequest, CapacityExceeded, UnknownSession, NotPermitted) as exc:
            code, message = status_of(exc), message_of(exc)
            self.refused_open(first.ByteSize())  # (an open may carry a deep prompt or LoRA matrices: MBs)
            if isinstance(exc, CapacityExceeded) and not self.accepting():  # draining: this server, not its load
                code = grpc.StatusCode.UNAVAILABLE
        if code is not None:
            await context.abort(code, message)
        session.detached_s = None
        self.attached.add(session.session_id)
        return session

    def _open_keys(self, first: pb.InferenceRequest) -> session_keys.SessionKeys | None:
        """The keys of a session opened with a key share (None: unkeyed), once the open's MAC matches them."""
        if not first.open.key_share:
            return None
        try:
            keys = self.server_key.keys(first.open.key_share)
        except ValueError as exc:
            raise InvalidRequest(f"open: bad key share ({exc})") from None
        if not session_keys.verified(keys.client, "", first):
            raise NotPermitted(f"open: its {session_keys.TAMPERED} (from its key share): changed on the way")
        return keys

    def _push_after(self, session: Session, reply: pb.InferenceReply, request: pb.InferenceRequest) -> bool:
        """Push a step's output on to the next server, after this session's earlier pushes (in step order), MACed
        with the next session's push key (sealed for us in the target). True when nothing is left to write (written
        already: `Pusher.push_now`; or not pushed at all, logged), False when a task writes it. A push that fails is logged: the client's stream to
        that server then breaks or times out, and its failover re-sends the step."""
        sid, step = session.session_id, request.step
        if step.push:  # (its own targets: the push hands the rest on, kept there too if it keeps its route)
            targets, keep = step.push, step.keep_route and len(step.push) > 1
        else:  # (a step on the route its source kept: `_step` pushes on only then)
            route = kept_route(session, pushed_in(request))
            targets, keep = [route.take()], route.onward
        push_key = b""
        if session.keys is not None and targets[0].push_key:
            push_key = session.push_key(targets[0].session_id, targets[0].push_key)
            if push_key is None:
                log.warning("step %d of session %s: the push key for %s is not sealed for us; not pushed",
                            step.step_id, sid, targets[0].address)
                return True
        if type(reply) is AnswerFrame:  # a plain decode step's ANSWER keeps its output's float32 bytes (compact.py)
            values, dims = reply.output
            hidden = pb.Tensor(data=values, dtype="float32", shape=dims)
        else:
            hidden = reply.hidden
        if type(step) is pb.InferenceStep:
            mask, op = step.attention_mask, step.cache_op if step.HasField("cache_op") else None
        else:  # (a compact step's: no mask, no cache op)
            mask, op = _NO_MASK, None
        args = (targets[0], hidden, mask, targets[1:], op, push_key, keep)
        previous = self._pushes.get(sid)
        now = self.pusher.push_now(*args) if previous is None or previous.done() else None
        if now is True:  # a PUSH_STEP, written: not answered unless refused (then logged by the pusher)
            self._pushes.pop(sid, None)
            return True
        if now is not None:
            self._pushes[sid] = now
            now.add_done_callback(functools.partial(self._pushed, sid, step.step_id, targets[0].address))
            return True

        async def push() -> bool:
            if previous is not None:
                await asyncio.gather(previous, return_exceptions=True)
            return await self.pusher.push(*args)

        task = asyncio.ensure_future(push())
        self._pushes[sid] = task
        task.add_done_callback(functools.partial(self._pushed, sid, step.step_id, targets[0].address))
        return False

    def _pushed(self, sid: str, step_id: int, address: str, push: asyncio.Future) -> None:
        """A push of session `sid` ended: a failure logged; the session's latest push forgotten."""
        if push.cancelled() or push.exception() is not None or not push.result():
            log.warning("push of step %d of session %s to %s failed", step_id, sid, address)
        if self._pushes.get(sid) is push:
            del self._pushes[sid]

    async def expire_loop(self, period_s: float = 0.5) -> None:
        cfg = self.config
        while True:
            await asyncio.sleep(period_s)
            for sid in self.sessions.expire(cfg.session_idle_timeout_s, cfg.resume_grace_s):
                self.attached.discard(sid)
                inbox = self.inboxes.get(sid)
                if inbox is not None:  # its stream ends too (a full inbox: its next step finds no session)
                    try:
                        inbox.put_nowait(_EXPIRED)
                    except asyncio.QueueFull:
                        pass
                log.info("session %s expired", sid)
