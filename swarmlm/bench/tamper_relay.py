"""A relay that splices and flips (issue 39, hole 1, the probe's attack): a working relay (swarm/relay.py) whose
circuits pass every byte on, except that the hidden states of the gRPC messages crossing it come out negated (the
sign bit of every float flipped, in place: the HTTP/2 and protobuf framing stay intact, so the receiver parses a
well-formed message with wrong values). Steps and pushes into the relayed server and its replies are all flipped.
Without end-to-end keys a client takes the flipped replies (wrong tokens); with them (wire/session_keys.py) each
end refuses them and the client fails over. `TamperingRelay.flipped` counts the messages it changed."""
from __future__ import annotations

import asyncio

from swarmlm.swarm.p2p_link import P2PNode, until_one_ends
from swarmlm.swarm.relay import RelayLimits, RelayService
from swarmlm.wire import swarm_pb2 as pb

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # what an HTTP/2 client writes first
_FRAME_HEADER = 9  # length (3), type (1), flags (1), stream id (4)
_DATA, _PADDED = 0, 0x8
_SIGN_BYTE = {"float32": (4, 3), "float16": (2, 1), "bfloat16": (2, 1)}  # bytes per value, the sign's byte
_TOWARDS_SERVER = (pb.InferenceRequest, pb.PushRequest)  # what a dialer sends (steps, pushes)
_TOWARDS_DIALER = (pb.InferenceReply,)


class TamperingRelay(RelayService):
    """A relay on its own P2P node whose circuits flip hidden states (`with TamperingRelay() as relay:`;
    `relay.address` goes first in a server's initial peers, so the server listens through it)."""

    def __init__(self, limits: RelayLimits = RelayLimits()) -> None:
        self.flipped = 0  # messages changed on the way
        node = P2PNode()
        super().__init__(node, None, limits)
        self.splice = self._flipping_splice
        self.address = str(node.run(node.p2p.get_visible_maddrs())[0])

    def __enter__(self) -> "TamperingRelay":
        return self

    def __exit__(self, *exc) -> None:
        self.node.shutdown()

    async def _flipping_splice(self, dialer, server, idle_timeout_s: float | None = None) -> None:
        tasks = [asyncio.create_task(self._pipe(dialer[0], server[1], _TOWARDS_SERVER, preface=True)),
                 asyncio.create_task(self._pipe(server[0], dialer[1], _TOWARDS_DIALER, preface=False))]
        await until_one_ends(tasks, (dialer[1], server[1]))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, kinds, preface: bool) -> None:
        """HTTP/2 frames from `reader` to `writer`, each DATA frame's hidden states negated."""
        try:
            if preface:
                writer.write(await reader.readexactly(len(_PREFACE)))
            while True:
                head = await reader.readexactly(_FRAME_HEADER)
                body = bytearray(await reader.readexactly(int.from_bytes(head[:3], "big")))
                if head[3] == _DATA:
                    self.flipped += flip_hidden(body, 1 + body[0] if head[4] & _PADDED and body else 0, kinds)
                writer.write(bytes(head) + bytes(body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return


def flip_hidden(body: bytearray, start: int, kinds) -> bool:
    """Negate, in place, the hidden states of the gRPC message at body[start:] (5 bytes of gRPC's prefix, then the
    message), read as one of `kinds`; False when there is none (not a whole message, not a step or reply)."""
    if len(body) < start + 5 or body[start] != 0:  # (compressed or cut: left alone)
        return False
    end = start + 5 + int.from_bytes(body[start + 1:start + 5], "big")
    if end > len(body):
        return False
    for kind in kinds:
        message = kind()
        try:
            message.ParseFromString(bytes(body[start + 5:end]))
        except Exception:  # (not this kind)
            continue
        tensor = message.hidden if kind is pb.InferenceReply else message.step.hidden
        if tensor.dtype not in _SIGN_BYTE or not tensor.data:
            continue
        size, sign = _SIGN_BYTE[tensor.dtype]
        count = 1
        for n in tensor.shape:
            count *= n
        at = body.find(tensor.data, start + 5, end)
        if count * size != len(tensor.data) or at < 0:
            continue
        for i in range(at + sign, at + len(tensor.data), size):
            body[i] ^= 0x80
        return True
    return False
