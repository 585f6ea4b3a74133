"""Server-to-server push: a step's output goes straight to the next server of the route.

Client-relayed, a token crosses 2N links through N servers (client -> s1 -> client -> s2 ...); pushed, N + 1
(client -> s1 -> s2 -> ... -> client). With a step the client names the servers after this one that await it
(address, its session there, the step id it takes there); the server replies to the client first, then pushes its
output to the first of them with the rest of the list, and so on down the chain. Every server still replies to the
client with its output: the client keeps each span's inputs for failover and reads every reply as soon as it
comes. A push that fails is not retried: the client sees the next server's stream break or time out, and its
failover re-sends the step from the inputs it kept.

A step can thus reach a server twice (a pushed copy and the client's own, after a failover). Step ids make that
harmless: `StepOrder` takes each id once and in order, and a duplicate gets no reply.
"""
from __future__ import annotations

import asyncio
import re
from collections import OrderedDict

import grpc

from swarmlm.client.transmission import Kind, Links, TransmissionPolicy
from swarmlm.errors import InvalidRequest
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire import swarm_pb2_grpc as pb_grpc

MAX_PUSH_TARGETS = 64  # the rest of a route: more servers than any route has
MAX_AHEAD = 8  # steps a session holds while waiting for an earlier id
MAX_CHANNELS = 64  # open channels to push targets (least recently used closed first)
_ADDRESS = re.compile(r"^[A-Za-z0-9.\-]{1,253}:[0-9]{1,5}$|^\[[0-9A-Fa-f:.]{2,45}\]:[0-9]{1,5}$")
_SESSION_ID = re.compile(r"^[0-9a-f]{1,64}$")


def check_targets(targets) -> None:
    """Validate a step's push targets before any compute."""
    if len(targets) > MAX_PUSH_TARGETS:
        raise InvalidRequest(f"push: {len(targets)} targets exceed the limit of {MAX_PUSH_TARGETS}")
    for t in targets:
        if not _ADDRESS.match(t.address) or not 0 < int(t.address.rsplit(":", 1)[1]) < 65536:
            raise InvalidRequest(f"push: {t.address[:80]!r} is not a host:port address")
        if not _SESSION_ID.match(t.session_id):
            raise InvalidRequest(f"push: {t.session_id[:80]!r} is not a session id")
        if t.step_id == 0:
            raise InvalidRequest("push: a pushed step needs a nonzero step id")


class StepOrder:
    """One session's steps, from its client and from pushes: each nonzero id once, in increasing order."""

    def __init__(self, last_id: int = 0) -> None:
        self.last_id = last_id
        self._ahead: dict[int, pb.InferenceRequest] = {}

    def admit(self, request: pb.InferenceRequest) -> list[pb.InferenceRequest]:
        """The steps that may run now, in order (none for a duplicate or a step ahead of its turn)."""
        step_id = request.step.step_id if request.WhichOneof("kind") == "step" else 0
        if step_id == 0:
            return [request]  # no id (or not a step: refused later): arrival order
        if step_id <= self.last_id or step_id in self._ahead:
            return []  # the other copy of a step already taken
        if step_id > self.last_id + 1:
            if len(self._ahead) >= MAX_AHEAD:
                raise InvalidRequest(f"step {step_id} is more than {MAX_AHEAD} steps ahead of step {self.last_id}")
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

    def __init__(self, max_message_bytes: int, timeout_s: float = 10.0) -> None:
        self.max_message_bytes = max_message_bytes
        self.timeout_s = timeout_s
        self.links = Links(TransmissionPolicy(prefill_window=None))
        self._channels: OrderedDict[str, tuple[grpc.aio.Channel, pb_grpc.SwarmStub]] = OrderedDict()
        self.pushed = 0
        self.failed = 0

    def _stub(self, address: str) -> pb_grpc.SwarmStub:
        if address in self._channels:
            self._channels.move_to_end(address)
            return self._channels[address][1]
        if len(self._channels) >= MAX_CHANNELS:
            _, (old, _) = self._channels.popitem(last=False)
            asyncio.ensure_future(old.close())
        channel = grpc.aio.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
        ])
        stub = pb_grpc.SwarmStub(channel)
        self._channels[address] = (channel, stub)
        return stub

    async def push(self, target: pb.PushTarget, hidden: pb.Tensor, mask: pb.Tensor,
                   rest: list[pb.PushTarget]) -> bool:
        """Deliver one output to `target` (which pushes it on to `rest`). True when the target accepted it."""
        request = pb.PushRequest(session_id=target.session_id, step=pb.InferenceStep(
            hidden=hidden, attention_mask=mask, step_id=target.step_id, push=rest))
        kind = Kind.DECODE if len(hidden.shape) == 3 and hidden.shape[1] == 1 else Kind.PREFILL
        link = self.links.get(target.address)
        call = None
        try:
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

    async def close(self) -> None:
        for channel, _ in self._channels.values():
            await channel.close()
        self._channels.clear()
