"""Server-to-server push: a step's output goes straight to the next server of the route.

Client-relayed, a token crosses 2N links through N servers (client -> s1 -> client -> s2 ...); pushed, N + 1
(client -> s1 -> s2 -> ... -> client). With a step the client names the servers after this one that await it
(address, its session there, the step id it takes there); the server pushes its output to the first of them with
the rest of the list, and so on down the chain: on gRPC starting each push before its reply to the client (the next
server waits for the push; the client does not wait for a middle server's reply), on the framed port right after
that reply is written (the push's wake-up of the next server can take this server's CPU before it writes anything
more, and the client needs every reply to end the step: server/session_stream.py). Every server still replies to the
client with its output: the client keeps each span's inputs for failover and reads every reply as soon as it
comes. A push that fails is not retried: the client sees the next server's stream break or time out, and its
failover re-sends the step from the inputs it kept.

A step can thus reach a server twice (a pushed copy and the client's own, after a failover). Step ids make that
harmless: `StepOrder` takes each id once and in order, and a duplicate gets no reply.

Trust: a push carries the target session's secret (the client hands it to the servers of its route), so a stranger
who only knows a session id cannot push into it; into a keyed session, also a MAC under that session's push key,
which the client seals for the pushing server alone (wire/session_keys.py): a relay on the way cannot change it. A server dials only servers of its swarm (`TargetCheck`): with a
DHT, addresses announced for the block after the session's span; without one (direct --servers mode), addresses
that answer Info as a server of the same model serving that block, probed at most once per `ttl_s` each and at
most `max_probes_per_min` in all, so a client cannot use a server to scan a network. A relayed target
(`p2p/<peer id>`) is reached only through the relay its own server's record names (server/network.py).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from collections import OrderedDict
from typing import Awaitable, Callable, Sequence

import grpc

from swarmlm.errors import InvalidRequest
from swarmlm.types import StepKind
from swarmlm.server.frame_push import FramePushes
from swarmlm.server.sessions import SECRET_BYTES
from swarmlm.wire import compact, session_keys
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire import swarm_pb2_grpc as pb_grpc
from swarmlm.wire.channel import aio_channel
from swarmlm.wire.frames import HEADER, Kind, frame
from swarmlm.wire.links import Links, TransmissionPolicy

log = logging.getLogger(__name__)

MAX_PUSH_TARGETS = 64  # the rest of a route: more servers than any route has
_KIND_AT = HEADER.size - 1  # a frame's kind byte
_ADDRESS = re.compile(r"^[A-Za-z0-9.\-]{1,253}:[0-9]{1,5}$|^\[[0-9A-Fa-f:.]{2,45}\]:[0-9]{1,5}$")
_P2P_ADDRESS = re.compile(r"^p2p/[1-9A-HJ-NP-Za-km-z]{40,60}$")  # a server behind NAT (swarm/records.py)
_SESSION_ID = re.compile(r"^[0-9a-f]{1,64}$")


def _address_ok(address: str) -> bool:
    if _P2P_ADDRESS.match(address):
        return True
    return bool(_ADDRESS.match(address)) and 0 < int(address.rsplit(":", 1)[1]) < 65536


def check_targets(targets) -> None:
    """Validate a step's push targets before any compute."""
    if len(targets) > MAX_PUSH_TARGETS:
        raise InvalidRequest(f"push: {len(targets)} targets exceed the limit of {MAX_PUSH_TARGETS}")
    for t in targets:
        if not _address_ok(t.address):
            raise InvalidRequest(f"push: {t.address[:80]!r} is not a host:port or p2p/<peer id> address")
        if not _SESSION_ID.match(t.session_id):
            raise InvalidRequest(f"push: {t.session_id[:80]!r} is not a session id")
        if t.step_id == 0:
            raise InvalidRequest("push: a pushed step needs a nonzero step id")
        if len(t.secret) != SECRET_BYTES:
            raise InvalidRequest(f"push: a target needs its session's {SECRET_BYTES}-byte secret")
        if t.push_key and len(t.push_key) != session_keys.SEALED_KEY_BYTES:
            raise InvalidRequest(f"push: a sealed push key is {session_keys.SEALED_KEY_BYTES} bytes, "
                                 f"got {len(t.push_key)}")


Directory = Callable[[int], Awaitable[set[str]]]  # addresses of servers announced for a block
Probe = Callable[[str], Awaitable["pb.InfoReply | None"]]  # a server's Info, or None if it does not answer


class TargetCheck:
    """Which addresses this server pushes to (see the module's docstring). Answers are cached per (address,
    block) for `ttl_s`."""

    def __init__(self, directory: Directory | None, probe: Probe, serves: Callable[[pb.InfoReply, int], bool],
                 ttl_s: float = 30.0, max_probes_per_min: int = 30) -> None:
        self.directory = directory
        self.probe = probe
        self.serves = serves  # does this Info describe a server of our model that serves the block?
        # a relayed (p2p/) address: is it reached through its own server's relay? (server/network.py); None = yes
        self.relay_check: Callable[[str], Awaitable[bool]] | None = None
        self.ttl_s = ttl_s
        self.max_probes_per_min = max_probes_per_min
        self._known: dict[tuple[str, int], tuple[bool, float]] = {}  # -> (allowed, until)
        self._probes: list[float] = []  # times of recent probes
        self._lookups: dict[int, tuple[set[str], float]] = {}  # block -> (announced addresses, when)

    async def allowed(self, address: str, block: int) -> bool:
        now = time.monotonic()
        known = self._known.get((address, block))
        if known is not None and known[1] > now:
            return known[0]
        if self.directory is not None:
            ok = address in await self._announced(block, now)
            if not ok:  # (not remembered: a server that just started or moved is pushed to once announced; the
                return False  # DHT is read at most once a second per block anyway)
            if self.relay_check is not None and not await self.relay_check(address):
                return False  # (not remembered either: the next read's claims are tried again)
        else:
            ok = await self._probe(address, block, now)
        if len(self._known) > 4096:  # bounded: forget everything rather than grow
            self._known.clear()
        self._known[(address, block)] = (ok, now + self.ttl_s)
        return ok

    async def _announced(self, block: int, now: float) -> set[str]:
        cached = self._lookups.get(block)
        if cached is not None and now - cached[1] < 1.0:  # at most one DHT lookup per block per second
            return cached[0]
        try:
            addresses = await self.directory(block)
        except Exception:  # the DHT did not answer: nothing is known to be announced
            addresses = set()
        self._lookups[block] = (addresses, now)
        return addresses

    async def _probe(self, address: str, block: int, now: float) -> bool:
        self._probes = [t for t in self._probes if now - t < 60.0]
        if len(self._probes) >= self.max_probes_per_min:
            return False
        self._probes.append(now)
        info = await self.probe(address)
        return info is not None and self.serves(info, block)


class KeptRoute:
    """Where a session's later plain decode steps from one source go (protocol 4, docs/PROTOCOL.md "Kept routes"):
    the next server's session as a step's first push target named it (address, session, secret, sealed push key),
    checked once, when the route was kept; each step pushed on takes the next step id there. `onward`: that server
    keeps the rest of the route itself (the set-up push handed it on with keep_route), so a push to it that cannot be
    a PUSH_STEP (gRPC) says keep_route too."""

    __slots__ = ("target", "onward")

    def __init__(self, target: pb.PushTarget, onward: bool) -> None:
        self.target = pb.PushTarget()
        self.target.CopyFrom(target)
        self.target.step_id += 1  # (the set-up step took its own id there)
        self.onward = onward

    def take(self) -> pb.PushTarget:
        """The next step's target (its step id), the route one step on."""
        target = pb.PushTarget()
        target.CopyFrom(self.target)
        self.target.step_id += 1
        return target


class PushedStep:
    """A PushRequest's step in its session's inbox: an InferenceRequest's duck (a step of the session, as
    `CompactStep` is one) that says it came by a push, the source whose kept route it may go on."""

    __slots__ = ("session_id", "step")
    WhichOneof = {"kind": "step"}.get
    pushed_in = True

    def __init__(self, session_id: str, step: pb.InferenceStep) -> None:
        self.session_id, self.step = session_id, step


def pushed_in(request) -> bool:
    """Did this step of a session come by a push (a PUSH's `PushedStep`, a PUSH_STEP's `CompactStep`), not from the
    session's own stream?"""
    return type(request) is not pb.InferenceRequest and request.pushed_in


def kept_route(session, from_push: bool) -> "KeptRoute | None":
    """The route a session's steps from that source go on (None: none kept)."""
    return session.push_route if from_push else session.stream_route


def route_rule(session, step: pb.InferenceStep, op, from_push: bool) -> tuple[bool, "KeptRoute | None"]:
    """A protobuf step's kept-route rule (protocol 4, docs/PROTOCOL.md "Kept routes"), checked before any compute:
    whether its output is pushed on, and its source's route once it is taken. keep_route with push targets keeps
    push[0] (replacing the route kept before); keep_route alone goes on the route kept; a step without keep_route
    drops it. Raises InvalidRequest (nothing changes) for keep_route on anything but a plain decode step (T = 1, no
    padding mask, no cache op, float32) of a keyed session into a keyed one, or keep_route alone with no route."""
    if not step.keep_route:
        return bool(step.push), None
    if session.keys is None or op is not None or not compact.plain_decode(step.hidden, step.attention_mask):
        raise InvalidRequest("keep_route: only on a plain decode step (one token, no padding mask, no cache op, "
                             "float32) of a keyed session")
    if step.push:
        if not step.push[0].push_key:
            raise InvalidRequest("keep_route: the next server's session is not keyed (its target has no push key)")
        return True, KeptRoute(step.push[0], onward=len(step.push) > 1)
    route = kept_route(session, from_push)
    if route is None:
        raise InvalidRequest("keep_route without push targets: no route is kept for this session's steps from its "
                             + ("pushes" if from_push else "stream"))
    return True, route


class StepOrder:
    """One session's steps, from its client and from pushes: each nonzero id once, in increasing order."""

    def __init__(self, max_ahead: int, last_id: int = 0) -> None:
        self.max_ahead = max_ahead  # ServerConfig.max_steps_ahead
        self.last_id = last_id
        self._ahead: dict[int, pb.InferenceRequest] = {}

    @property
    def idle(self) -> bool:
        """Nothing held for an earlier id."""
        return not self._ahead

    def holds(self, request: pb.InferenceRequest) -> bool:
        """Is `request` waiting here for an earlier id?"""
        return any(held is request for held in self._ahead.values())

    def admit(self, request: pb.InferenceRequest) -> list[pb.InferenceRequest]:
        """The steps that may run now, in order (none for a duplicate or a step ahead of its turn)."""
        step_id = request.step.step_id if request.WhichOneof("kind") == "step" else 0
        if step_id == 0:
            return [request]  # no id (or not a step: refused later): arrival order
        if step_id <= self.last_id or step_id in self._ahead:
            return []  # the other copy of a step already taken
        if step_id > self.last_id + 1:
            if len(self._ahead) >= self.max_ahead:
                raise InvalidRequest(
                    f"step {step_id} is more than {self.max_ahead} steps ahead of step {self.last_id}")
            self._ahead[step_id] = request
            return []
        ready = [request]
        self.last_id = step_id
        while self.last_id + 1 in self._ahead:
            self.last_id += 1
            ready.append(self._ahead.pop(self.last_id))
        return ready


class Pusher:
    """Outgoing pushes: one channel per target address, writes ordered decode-first per link (as the client's)."""

    def __init__(self, max_message_bytes: int, timeout_s: float, interceptors: Sequence = (),
                 frames: bool = False, swarm_key: bytes | None = None, *, max_channels: int) -> None:
        self.max_message_bytes = max_message_bytes
        self.max_channels = max_channels  # ServerConfig.max_push_channels
        self.interceptors = interceptors  # a private swarm's token on every push (swarm/private.py)
        self.timeout_s = timeout_s  # ServerConfig.push_timeout_s
        self.links = Links(TransmissionPolicy(prefill_window=None))
        self._channels: OrderedDict[str, tuple[grpc.aio.Channel, pb_grpc.SwarmStub]] = OrderedDict()
        # pushes on the target's framed port when it has one (server/frame_push.py); None = gRPC only
        self.framed = FramePushes(self.info, swarm_key, max_message_bytes, refused=self._refused) if frames else None
        self.pushed = 0
        self.failed = 0
        self.compact_frames = 0  # pushes written as PUSH_STEP frames (wire/compact.py)

    def _stub(self, address: str) -> pb_grpc.SwarmStub:
        if address in self._channels:
            self._channels.move_to_end(address)
            return self._channels[address][1]
        if len(self._channels) >= self.max_channels:
            _, (old, _) = self._channels.popitem(last=False)
            asyncio.ensure_future(old.close())
        channel = aio_channel(address, self.max_message_bytes, self.interceptors)
        stub = pb_grpc.SwarmStub(channel)
        self._channels[address] = (channel, stub)
        return stub

    def push_now(self, target: pb.PushTarget, hidden: pb.Tensor, mask: pb.Tensor, rest: list[pb.PushTarget],
                 op: pb.CacheOp | None = None, push_key: bytes = b"",
                 keep_route: bool = False) -> asyncio.Future | bool | None:
        """`push`, written now from the caller's path when nothing has to be awaited first: the target's framed
        port known, a kept connection free, no message waiting for its turn on the link (so decode-first has
        nothing to order). The future: whether the target accepted it; True: a PUSH_STEP, written and not
        answered unless refused (`_refused`). None: nothing done, use `push`."""
        framed = self.framed
        if framed is None:
            return None
        link = self.links.get(target.address)
        if not framed.known_port(target.address) or not link.free():
            return None
        conn = framed.idle(target.address)
        if conn is None:
            return None
        data = self._frame(target, hidden, mask, rest, op, push_key, keep_route)
        link.written_outside(StepKind.of(hidden.shape[1] if len(hidden.shape) == 3 else 0))
        if data[_KIND_AT] == Kind.PUSH_STEP:
            self._unanswered(target.address, conn, data)
            return True
        done = asyncio.get_running_loop().create_future()
        conn.write(data, self.timeout_s, functools.partial(self._answered, target.address, done))
        return done

    async def push(self, target: pb.PushTarget, hidden: pb.Tensor, mask: pb.Tensor,
                   rest: list[pb.PushTarget], op: pb.CacheOp | None = None, push_key: bytes = b"",
                   keep_route: bool = False) -> bool:
        """Deliver one output to `target` (which pushes it on to `rest`), with the step's cache op: every span of a
        session holds the same tokens and rows, so the op is the same there; MACed with the target session's
        `push_key` when it is keyed (wire/session_keys.py). `keep_route`: the step's, for the target (it keeps
        `rest`, or pushes on the route it kept: `KeptRoute`). True when the target accepted it."""
        kind = StepKind.of(hidden.shape[1] if len(hidden.shape) == 3 else 0)
        link = self.links.get(target.address)
        call = None
        try:
            port = await self.framed.port(target.address) if self.framed is not None else 0
            if port:
                data = self._frame(target, hidden, mask, rest, op, push_key, keep_route)
                accepted = await self._framed(link, kind, target.address, port, data)
                if accepted is not None:
                    return accepted
            request = self._request(target, hidden, mask, rest, op, keep_route)
            if push_key:
                session_keys.sign(push_key, target.session_id, request)
            async with link.turn(kind):
                call = self._stub(target.address).Push(request, timeout=self.timeout_s)
                await asyncio.sleep(0)  # let the call start writing before the next message's turn
            await call
            self.pushed += 1
            return True
        except (grpc.aio.AioRpcError, OSError, ValueError):
            self.failed += 1
            return False
        finally:
            if call is not None:
                link.answered(kind)

    @staticmethod
    def _request(target: pb.PushTarget, hidden: pb.Tensor, mask: pb.Tensor, rest: list[pb.PushTarget],
                 op: pb.CacheOp | None, keep_route: bool = False) -> pb.PushRequest:
        return pb.PushRequest(session_id=target.session_id, secret=target.secret, step=pb.InferenceStep(
            hidden=hidden, attention_mask=mask, step_id=target.step_id, push=rest, cache_op=op,
            keep_route=keep_route))

    def _frame(self, target: pb.PushTarget, hidden: pb.Tensor, mask: pb.Tensor, rest: list[pb.PushTarget],
               op: pb.CacheOp | None, push_key: bytes, keep_route: bool = False) -> bytes:
        """The push as a whole frame for the target's framed port: a PUSH_STEP (wire/compact.py: the output's bytes
        as they are, no protobuf) for a plain decode step into a keyed session with no targets to hand on (the
        route's last server, or one that pushes on the route it kept), else a PUSH (the PushRequest serialized once,
        MACed with `push_key` if given: `signed_bytes`)."""
        if push_key and not rest and op is None and compact.plain_decode(hidden, mask):
            self.compact_frames += 1
            shape = hidden.shape
            return compact.push_frame(push_key, target.session_id, target.secret, target.step_id, shape[0], 1,
                                      shape[2], hidden.data)
        request = self._request(target, hidden, mask, rest, op, keep_route)
        return frame(Kind.PUSH, session_keys.signed_bytes(push_key, target.session_id, request) if push_key
                            else request.SerializeToString())

    def _unanswered(self, address: str, conn, data: bytes) -> None:
        """A PUSH_STEP written on `conn`: counted as pushed (a refusal comes later, to `_refused`), `conn` kept."""
        conn.write_unanswered(data)
        self.pushed += 1
        self.framed.keep(address, conn)

    def _refused(self, step_id: int, code: grpc.StatusCode, details: str) -> None:
        """A PUSH_STEP refused by its target (a REFUSED, whenever it comes): counted, logged. The client's stream to
        that server gets no reply for the step, and its hang timeout and failover take it from there, as for a
        push refused by a STATUS."""
        self.pushed -= 1
        self.failed += 1
        log.warning("a compact push of step %d was refused: %s %s", step_id, code.name, details[:200])

    def _answered(self, address: str, done: asyncio.Future, conn, code: grpc.StatusCode | None, _: str) -> None:
        """A framed push's answer (code None: none came): counted, its connection kept if OK, `done` resolved."""
        accepted = code == grpc.StatusCode.OK
        self.pushed += accepted
        self.failed += not accepted
        if accepted:
            self.framed.keep(address, conn)
        if not done.done():
            done.set_result(accepted)

    async def _framed(self, link, kind: StepKind, address: str, port: int, data: bytes) -> bool | None:
        """A push (`data`: a whole PUSH or PUSH_STEP frame, `_frame`) on the framed port: whether the target accepted
        it (a PUSH_STEP: True once written), or None when the port does not take the connection (then forgotten:
        this push and later ones go by gRPC).
        Held on the link like a gRPC push: its turn until written, in flight until answered."""
        done = asyncio.get_running_loop().create_future()
        async with link.turn(kind):
            conn = self.framed.idle(address)
            if conn is None:
                try:
                    conn = await self.framed.connect(address, port, self.timeout_s)
                except (OSError, TimeoutError):
                    self.framed.forget(address)
                    link.answered(kind)
                    return None
            if data[_KIND_AT] == Kind.PUSH_STEP:
                self._unanswered(address, conn, data)
                link.answered(kind)
                return True
            conn.write(data, self.timeout_s, functools.partial(self._answered, address, done))
        try:
            return await done
        finally:
            link.answered(kind)

    async def info(self, address: str, nonce: bytes = b"", timeout_s: float = 2.0) -> pb.InfoReply | None:
        """The Info of the server at `address` (signed over `nonce` if given), or None if nothing there answers as
        one."""
        try:
            return await self._stub(address).Info(pb.InfoRequest(nonce=nonce), timeout=timeout_s)
        except (grpc.aio.AioRpcError, OSError, ValueError):
            return None

    async def close(self) -> None:
        if self.framed is not None:
            await self.framed.close()
        for channel, _ in self._channels.values():
            await channel.close()
        self._channels.clear()
