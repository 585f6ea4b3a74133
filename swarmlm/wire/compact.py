"""Compact frames for the plain decode step of a keyed session on a framed stream (docs/PROTOCOL.md, "Framed steps"):
STEP (client -> server) and ANSWER (server -> client), a fixed big-endian header + the raw float32 hidden states
(little-endian, as a Tensor's bytes) + a 16-byte keyed BLAKE2b MAC, instead of an InferenceRequest / InferenceReply. The
same checks as the protobuf step (the server's dims and limits, finiteness, the MAC under the session's client / server
key), with fewer Python calls: no protobuf message is built, serialized or parsed, and the MAC is taken over the frame's
bytes as they are.

    STEP body:   step id (u64), B (u16), T (u16), H (u32) | B*T*H float32 | MAC (16)
    ANSWER body: step id (u64), position (u32), batched steps (u32), flags (u8: 1 = pushed on), queued_s, compute_s,
                 parse_s, encode_s (f64 each) | B*T*H float32 (the step's B, T, H) | MAC (16)
    PUSH_STEP body (server -> server, on a push connection): session id length (u8), the target session's id (ASCII),
                 its secret (16) | a STEP body's header and values (step id, B, T, H | B*T*H float32) | MAC (16)

The MAC is keyed BLAKE2b (RFC 7693) of session id + "\\n" + every body byte before it, personalised "swarmlm-step" /
"swarmlm-answer" / "swarmlm-push" (a PUSH_STEP's, under the target session's push key): a different BLAKE2b parameter
block from the protobuf messages' MAC (no personalisation), so no compact frame's MAC can ever be taken for a protobuf
message's, nor one kind's for another's.

Only a decode step (T = 1) with no mask (no padding), no push targets, no cache op, float32 on the link goes compact
(client/streams.py `SpanStream._compact`); everything else (opens, prefills, replays, speculation's passes, pushed
routes, saves) stays protobuf. A refused STEP is answered by the usual protobuf REPLY with its error. Such a decode
step with push targets (a pushed route's) is a REQUEST, but answered by an ANSWER flagged PUSHED.

A server pushes a PUSH_STEP (server/push.py `Pusher`) for the same kind of step when the push carries no onward targets
(the route's last server: a middle one's push carries the rest of the route, and stays a PushRequest) into a keyed
session; the taker queues its STEP part as a `CompactStep` (the same checks from there, answered to the client by an
ANSWER) once the session's secret and the MAC under its push key match (`PushStep`).
"""
from __future__ import annotations

import hashlib
import hmac
import struct

import numpy as np
import torch

from swarmlm.errors import InvalidRequest
from swarmlm.wire import frames
from swarmlm.wire.frames import Kind
from swarmlm.wire.session_keys import MAC_BYTES

SECRET_BYTES = 16  # a session's secret, 128 bits (server/sessions.py: a PUSH_STEP carries it)

STEP_HEAD = struct.Struct(">QHHI")  # step id, B, T, H (network order, as the frame header: packed with it)
ANSWER_HEAD = struct.Struct(">QIIBdddd")  # step id, position, batched steps, flags, queued, compute, parse, encode (s)
PUSHED = 1  # an ANSWER's flag: the server pushed this step's output on (its step carried push targets)
MAX_DIM = 0xFFFF  # B and T are u16 on the wire: a step larger than this goes protobuf
_STEP_PERSON, _ANSWER_PERSON, _PUSH_PERSON = b"swarmlm-step", b"swarmlm-answer", b"swarmlm-push"
_STEP_FRAME_HEAD = struct.Struct(">IBQHHI")  # frames.HEADER + STEP_HEAD: one pack per frame
_ANSWER_FRAME_HEAD = struct.Struct(">IBQIIBdddd")
assert _STEP_FRAME_HEAD.size == frames.HEADER.size + STEP_HEAD.size  # (the struct's byte order only: no padding)
assert _ANSWER_FRAME_HEAD.size == frames.HEADER.size + ANSWER_HEAD.size


def _tag(key: bytes, person: bytes, session_id: str, *parts) -> bytes:
    digest = hashlib.blake2b(session_id.encode() + b"\n", digest_size=MAC_BYTES, key=key, person=person)
    for part in parts:
        digest.update(part)
    return digest.digest()


Values = bytes | memoryview | np.ndarray  # float32 in C order: bytes, a byte view, or `float32_values`' array


def step_frame(key: bytes, session_id: str, step_id: int, b: int, t: int, h: int, values: Values) -> bytes:
    """A whole STEP frame (frame header included): `values` the B*T*H float32 in C order."""
    # (an array's len is its first dim's; inline, not a helper: one Python call less per frame)
    nbytes = values.nbytes if type(values) is np.ndarray else len(values)
    head = _STEP_FRAME_HEAD.pack(STEP_HEAD.size + nbytes + MAC_BYTES, Kind.STEP, step_id, b, t, h)
    return b"".join((head, values, _tag(key, _STEP_PERSON, session_id, head[frames.HEADER.size:], values)))


def eligible_dims(b: int, t: int) -> bool:
    """Do B and T fit a STEP's header?"""
    return 0 < b <= MAX_DIM and 0 < t <= MAX_DIM


def plain_decode(hidden, mask) -> bool:
    """Do a protobuf step's hidden state and mask (pb.Tensor) make a plain decode step, the kind that goes compact:
    float32 [B, 1, H] with B within the header's u16, no padding mask? (The client's rule, `SpanStream._compact`,
    on the wire's tensors: a server answers or pushes on such a step compact.)"""
    shape = hidden.shape
    return not mask.dtype and hidden.dtype == "float32" and len(shape) == 3 and shape[1] == 1 and \
        eligible_dims(shape[0], 1)


def push_frame(key: bytes, session_id: str, secret: bytes, step_id: int, b: int, t: int, h: int,
               values: bytes | memoryview) -> bytes:
    """A whole PUSH_STEP frame into session `session_id` (its `secret`), MACed with its push `key`: `values` the
    B*T*H float32 in C order."""
    sid = session_id.encode("ascii")
    head = b"".join((frames.HEADER.pack(1 + len(sid) + len(secret) + STEP_HEAD.size + len(values) + MAC_BYTES,
                                      Kind.PUSH_STEP), bytes((len(sid),)), sid, secret,
                     STEP_HEAD.pack(step_id, b, t, h)))
    return b"".join((head, values, _tag(key, _PUSH_PERSON, session_id, head[frames.HEADER.size:], values)))


class PushStep:
    """A PUSH_STEP frame's body as the taker reads it: `session_id` and `secret` to find and own the session,
    `verified` its MAC under the session's push key, `step` its STEP part (a `CompactStep` over the same bytes).
    A body too short for its own header reads as session "" (no session has that id: refused as unknown)."""

    __slots__ = ("body", "session_id", "secret", "step_id", "_at", "via")

    def __init__(self, body: bytes, via=None) -> None:
        self.body = body
        self.via = via  # the connection it came on (the framed port's; None: unknown), where a step lane may read
        n = body[0] if body else 0
        self._at = at = 1 + n + SECRET_BYTES  # where its STEP part starts
        if len(body) < at + STEP_HEAD.size + MAC_BYTES:
            self.session_id, self.secret, self.step_id = "", b"", 0
            return
        self.step_id = STEP_HEAD.unpack_from(body, at)[0]  # (a refusal names it)
        try:
            self.session_id = body[1:1 + n].decode("ascii")
        except UnicodeDecodeError:
            self.session_id = ""
        self.secret = body[1 + n:at]

    def ByteSize(self) -> int:  # (what a refusal weighs: UnaryGate trims after a large one, as for a PushRequest)
        return len(self.body)

    def verified(self, key: bytes) -> bool:
        """Does the frame end with the MAC of all its bytes before it under the push key `key`?"""
        body = self.body
        size = len(body) - MAC_BYTES
        if not self.session_id:
            return False
        view = memoryview(body)
        return hmac.compare_digest(view[size:], _tag(key, _PUSH_PERSON, self.session_id, view[:size]))

    @property
    def step(self) -> "CompactStep":
        """Its STEP part (header, values, MAC): checked from here as a STEP is (dims, length, finiteness)."""
        return CompactStep(memoryview(self.body)[self._at:], pushed_in=True, via=self.via)


class CompactStep:
    """A STEP frame's body as the server's step path takes it: duck-typed where it meets an InferenceRequest (a
    step of the stream's session, its `step.step_id`), its MAC checked by `verified`, its values by `values`."""

    __slots__ = ("body", "step_id", "b", "t", "h", "nbytes", "pushed_in", "via")
    session_id = ""  # (the stream's session: a STEP names none)
    push = ()  # (no targets of its own: pushed on only on a route its source kept, server/push.py KeptRoute)
    keep_route = False  # (a source's route: kept, not dropped, by its compact steps)
    # a step (StepOrder, the stream's loop and `_step` ask): a C method, not a Python function, called ~4 times a step
    WhichOneof = {"kind": "step"}.get

    def __init__(self, body: bytes, pushed_in: bool = False, via=None) -> None:
        self.body = body
        self.pushed_in = pushed_in  # a PUSH_STEP's (`PushStep.step`), not a STEP of the session's stream
        self.via = via  # (a PUSH_STEP's) the push connection it came on, if known
        size = len(body)
        self.nbytes = max(size - STEP_HEAD.size - MAC_BYTES, 0)  # its values' bytes (its charge while it waits)
        if size >= STEP_HEAD.size:
            self.step_id, self.b, self.t, self.h = STEP_HEAD.unpack_from(body)
        else:  # (no MAC either: `verified` refuses it)
            self.step_id, self.b, self.t, self.h = 0, 0, 0, 0

    @property
    def step(self) -> "CompactStep":  # (StepOrder reads request.step.step_id)
        return self

    def verified(self, key: bytes, session_id: str) -> bool:
        """Does the frame end with the MAC of all its bytes before it, under the client key `key`? (A body too short
        to hold a header and a MAC has none: False.)"""
        body = self.body
        size = len(body) - MAC_BYTES
        if size < STEP_HEAD.size:
            return False
        view = memoryview(body)
        return hmac.compare_digest(view[size:], _tag(key, _STEP_PERSON, session_id, view[:size]))

    def values(self) -> np.ndarray:
        """The values as a flat read-only float32 array over the body, once its length matches its dims."""
        self.check_length()
        return np.frombuffer(self.body, dtype=np.float32, count=self.b * self.t * self.h, offset=STEP_HEAD.size)

    def check_length(self) -> None:
        """InvalidRequest unless the body's length is its dims' (header, B*T*H float32, MAC)."""
        expected = STEP_HEAD.size + self.b * self.t * self.h * 4 + MAC_BYTES
        if len(self.body) != expected:
            raise InvalidRequest(f"STEP: {len(self.body)} bytes do not match its dims [{self.b}, {self.t}, {self.h}] "
                                 f"({expected} bytes with header and MAC)")


def float32_values(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's values for a STEP or an ANSWER (a client's first hop's input, a server's output): float32 in C
    order, an array over the tensor's own memory when it is that already (the frame copies them as it is built: no
    bytes object made first; right after a forward each call and copy costs ~10x, docs/RESULTS-hop.md round 18)."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.dtype != torch.float32:
        tensor = tensor.float()
    values = tensor.numpy()
    return values if values.flags.c_contiguous else np.ascontiguousarray(values)


class AnswerFrame(bytes):
    """A whole ANSWER frame, ready to write: the stream's loop sends it as it is. An answer to a step with push
    targets (`pushed`) also keeps `output`: its values' float32 bytes and [B, T, H], which the server pushes on."""

    pushed = False
    output: tuple[bytes, tuple[int, int, int]] | None = None


def answer_frame(key: bytes, session_id: str, step_id: int, position: int, values: Values, queued_s: float,
                 compute_s: float, parse_s: float, encode_s: float, batched_steps: int,
                 pushed_dims: tuple[int, int, int] | None = None) -> AnswerFrame:
    """The ANSWER to a STEP (or to a plain decode step, pushed or pushing): `values` its output's float32 (the
    step's dims). `pushed_dims`: the step's [B, T, H] when the server pushes its output on (flag PUSHED; the frame
    keeps `output`, the values as bytes, for the push)."""
    nbytes = values.nbytes if type(values) is np.ndarray else len(values)  # (as in step_frame)
    head = _ANSWER_FRAME_HEAD.pack(ANSWER_HEAD.size + nbytes + MAC_BYTES, Kind.ANSWER, step_id, position,
                                   batched_steps, PUSHED if pushed_dims else 0, queued_s, compute_s, parse_s, encode_s)
    frame = AnswerFrame(b"".join((head, values, _tag(key, _ANSWER_PERSON, session_id, head[frames.HEADER.size:],
                                                     values))))
    if pushed_dims:
        frame.pushed, frame.output = True, (bytes(values), pushed_dims)
    return frame


def answer_values(frame: bytes) -> bytes:
    """A whole ANSWER frame's output values (float32 bytes, between its header and its MAC)."""
    return frame[frames.HEADER.size + ANSWER_HEAD.size:len(frame) - MAC_BYTES]


class Answer:
    """An ANSWER frame's body as the client reads it (`opened` checks it)."""

    __slots__ = ("body", "step_id", "position", "batched_steps", "pushed", "queued_s", "compute_s", "parse_s",
                 "encode_s", "values")

    def __init__(self, body: bytes) -> None:
        self.body = body

    def opened(self, key: bytes, session_id: str, count: int) -> "Answer":
        """Checked: its MAC under the server key `key` first, then its length for `count` values. Returns self with
        its fields set (`values`: the output's float32 bytes, a view of the body, as `data()`); `Tampered` if its MAC
        does not match (or it has none), InvalidRequest if its length is not the step's."""
        body = self.body
        size = len(body) - MAC_BYTES
        view = memoryview(body)
        if size < ANSWER_HEAD.size or not hmac.compare_digest(
                view[size:], _tag(key, _ANSWER_PERSON, session_id, view[:size])):
            raise Tampered()
        if size != ANSWER_HEAD.size + count * 4:
            raise InvalidRequest(f"ANSWER: {size - ANSWER_HEAD.size} value bytes, the step has {count * 4}")
        (self.step_id, self.position, self.batched_steps, flags, self.queued_s, self.compute_s, self.parse_s,
         self.encode_s) = ANSWER_HEAD.unpack_from(body)
        self.pushed = bool(flags & PUSHED)
        self.values = view[ANSWER_HEAD.size:size]  # (kept: the client reads it without one more call)
        return self

    def data(self) -> memoryview:
        """The output's float32 bytes (a view of the body; once `opened`)."""
        return self.values


class Tampered(Exception):
    """A compact frame whose MAC does not match its session's key (or that has none)."""
