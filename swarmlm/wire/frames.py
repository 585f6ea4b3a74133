"""Framed steps: an Inference stream (or a server's pushes) as length-prefixed frames on a plain TCP connection,
beside gRPC (docs/PROTOCOL.md, "Framed steps"). The messages inside are the same protobufs as gRPC's; only the
envelope is leaner: a decode step costs one read and one write per side, no HTTP/2, no grpc.aio thread hand-off.

A frame: 4 bytes body length (unsigned, big-endian), 1 byte kind, then the body. A connection starts with one
HELLO frame (the magic line, the purpose, a private swarm's token); every frame after it is checked against what
may come next. Anything else (a wrong magic, an unknown kind, a frame over the size limit, a kind out of turn, a
connection cut inside a frame) is a FrameError with a one-line reason.
"""
from __future__ import annotations

import asyncio
import struct
from enum import IntEnum

import grpc

from swarmlm.wire.protocol import PROTOCOL_VERSION

# the wire protocol's number is in the magic: a server refuses a dialer of another protocol at its first frame
MAGIC_PREFIX = b"swarmlm-frames/"
MAGIC = MAGIC_PREFIX + b"%d\n" % PROTOCOL_VERSION
HEADER = struct.Struct(">IB")  # body bytes, kind
HELLO_TIMEOUT_S = 5.0  # a connection that has not said HELLO by then is closed
MAX_HELLO_BYTES = 512  # magic + purpose + token (a token is < 200 bytes)
MAX_STATUS_BYTES = 4096
# the gRPC method a framed connection stands for: its HELLO's private-swarm token is made for this name
INFERENCE_METHOD = "/swarmlm.Swarm/Inference"
PUSH_METHOD = "/swarmlm.Swarm/Push"


class Kind(IntEnum):
    HELLO = 1  # first frame of a connection: MAGIC + purpose (1 byte) + the swarm-key token (ASCII, maybe empty)
    REQUEST = 2  # client -> server: an InferenceRequest
    END = 3  # client -> server: no more requests (gRPC's half-close); empty body
    REPLY = 4  # server -> client: an InferenceReply
    STATUS = 5  # server -> client: the stream's end (or a push's answer): status code name, "\n", details
    PUSH = 6  # server -> server: a PushRequest; answered by one STATUS (OK or the refusal), then the next push
    STEP = 7  # client -> server: a plain decode step of a keyed session, compact (wire/compact.py)
    ANSWER = 8  # server -> client: the answer to a STEP, compact (a refused STEP is answered by a REPLY)
    PUSH_STEP = 9  # server -> server: a plain decode step pushed to a route's last server, compact (wire/compact.py);
    # answered only if refused, by a REFUSED
    REFUSED = 10  # server -> server: a PUSH_STEP refused: its step id (u64), then a STATUS body (code name, details)


_KINDS: dict[int, Kind] = dict(Kind._value2member_map_)


class Purpose(IntEnum):
    STREAM = 1  # one Inference stream: REQUEST or STEP... END from the client; REPLY or ANSWER... STATUS from server
    PUSH = 2  # a sequence of pushes: PUSH or PUSH_STEP from the pusher; STATUS for each PUSH, REFUSED for a refused
    # PUSH_STEP (an accepted one is not answered)


class FrameError(Exception):
    """The peer broke the framing; the connection is closed after a STATUS saying why (when it can be sent)."""


def frame(kind: Kind, body: bytes = b"") -> bytes:
    return HEADER.pack(len(body), kind) + body


def hello(purpose: Purpose, token: str | None) -> bytes:
    return frame(Kind.HELLO, MAGIC + bytes([purpose]) + (token or "").encode("ascii"))


def parse_hello(body: bytes) -> tuple[Purpose, str | None]:
    if not body.startswith(MAGIC) or len(body) < len(MAGIC) + 1:
        raise FrameError(_wrong_magic(body))
    try:
        purpose = Purpose(body[len(MAGIC)])
        token = body[len(MAGIC) + 1:].decode("ascii")
    except (ValueError, UnicodeDecodeError):
        raise FrameError("HELLO: unknown purpose or a token that is not ASCII") from None
    return purpose, token or None


def _wrong_magic(body: bytes) -> str:
    """A dialer of another wire protocol is told so in one line (wire/protocol.py); anything else is not ours."""
    number, newline, _ = body[len(MAGIC_PREFIX):].partition(b"\n")
    if body.startswith(MAGIC_PREFIX) and newline and number.isdigit() and len(number) <= 5 \
            and int(number) != PROTOCOL_VERSION:
        return (f"the dialer speaks swarmlm wire protocol {int(number)}, this server protocol {PROTOCOL_VERSION}: "
                "run the same swarmlm release on both")
    return "not a swarmlm frame connection (wrong magic in HELLO)"


def _status_body(code: grpc.StatusCode, details: str, limit: int) -> bytes:
    """A STATUS body (code name, "\\n", details), cut to `limit` bytes."""
    return f"{code.name}\n{details}".encode("utf-8", "replace")[:limit]


def status(code: grpc.StatusCode, details: str = "") -> bytes:
    return frame(Kind.STATUS, _status_body(code, details, MAX_STATUS_BYTES))


OK_STATUS = status(grpc.StatusCode.OK)  # the frame of the usual answer (a push's): built once, compared whole
REFUSED_STEP = struct.Struct(">Q")  # a REFUSED body's head: the refused PUSH_STEP's step id


def refused(step_id: int, code: grpc.StatusCode, details: str) -> bytes:
    """The answer to a refused PUSH_STEP: its step id, then the refusal as a STATUS body."""
    return frame(Kind.REFUSED,
                 REFUSED_STEP.pack(step_id) + _status_body(code, details, MAX_STATUS_BYTES - REFUSED_STEP.size))


def parse_refused(body: bytes) -> tuple[int, grpc.StatusCode, str]:
    """A REFUSED body from a peer: (step id, code, details); FrameError if it is too short for its step id."""
    if len(body) < REFUSED_STEP.size:
        raise FrameError(f"REFUSED: {len(body)} bytes, shorter than its step id")
    return (REFUSED_STEP.unpack_from(body)[0], *parse_status(body[REFUSED_STEP.size:]))


def parse_status(body: bytes) -> tuple[grpc.StatusCode, str]:
    """A STATUS body from a peer; an unknown code name is UNKNOWN (with the details kept)."""
    name, _, details = body.decode("utf-8", "replace").partition("\n")
    code = grpc.StatusCode.__members__.get(name, grpc.StatusCode.UNKNOWN)
    return code, details[:MAX_STATUS_BYTES]


def frame_target(address: str, port: int) -> tuple[str, int]:
    """(host, port) of the framed port of the server at host:port `address`."""
    return address.rsplit(":", 1)[0].strip("[]"), port


async def connect(host: str, port: int, purpose: Purpose, token: str | None,
                  timeout_s: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to a framed port, its HELLO written (`token`: a private swarm's, for the purpose's method).
    OSError or TimeoutError if it fails."""
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_connection(host, port)
    writer.write(hello(purpose, token))
    return reader, writer


def parse_frame(buf: bytearray, max_body_bytes: int) -> tuple[Kind, bytes] | None:
    """Take the first whole frame off `buf` (bytes read so far from a connection); None while it is incomplete. A
    header that breaks the framing (unknown kind, over the limit) is a FrameError as soon as it is there."""
    if len(buf) < HEADER.size:
        return None
    size, number = HEADER.unpack_from(buf)
    kind = _KINDS.get(number)  # (a dict's lookup: Kind(number) is two Python calls, on every frame)
    if kind is None:
        raise FrameError(f"unknown frame kind {number}")
    if size > max_body_bytes:
        raise FrameError(f"oversized frame: {size} bytes exceed the limit of {max_body_bytes}")
    end = HEADER.size + size
    if len(buf) < end:
        return None
    body = bytes(buf[HEADER.size:end])
    del buf[:end]
    return kind, body


async def read_frame(reader: asyncio.StreamReader, max_body_bytes: int,
                     body_timeout_s: float | None = None) -> tuple[Kind, bytes] | None:
    """The next frame, or None at a clean end of the connection (between frames). Waits as long as it takes for a
    frame to begin; once begun, its body must arrive within `body_timeout_s`."""
    try:
        head = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise FrameError(f"truncated frame: the connection ended after {len(exc.partial)} of "
                         f"{HEADER.size} header bytes") from None
    size, kind = HEADER.unpack(head)
    if kind not in Kind._value2member_map_:
        raise FrameError(f"unknown frame kind {kind}")
    if size > max_body_bytes:
        raise FrameError(f"oversized frame: {size} bytes exceed the limit of {max_body_bytes}")
    try:
        async with asyncio.timeout(body_timeout_s):
            body = await reader.readexactly(size)
    except asyncio.IncompleteReadError as exc:
        raise FrameError(f"truncated frame: the connection ended after {len(exc.partial)} of {size} body "
                         f"bytes") from None
    except TimeoutError:
        raise FrameError(f"a frame of {size} bytes did not arrive within {body_timeout_s} s") from None
    return Kind(kind), body
