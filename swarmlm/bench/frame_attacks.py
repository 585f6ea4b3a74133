"""Hostile frames against a server's framed step port (wire/frames.py), light in tests/test_attacks.py and
tests/test_fuzz_rpc.py, heavy in benchmarks/attacks.py. Each case opens its own connection with a blocking socket
and returns what the server answered: "STATUS <CODE> <details>", "REPLY ..." or "closed" (it closed without a
word: a connection cut inside a frame cannot be answered). Compact decode frames (wire/compact.py): hostile STEPs
in a keyed session of their own (`KeyedStream`, `compact_cases`), and hostile compact pushes (PUSH_STEP) into one
(`push_cases`)."""
from __future__ import annotations

import random
import socket

import torch

from swarmlm.wire import codec, frames
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire.frames import HEADER, Kind, Purpose

TIMEOUT_S = 30.0  # a generous wait for the server's answer (the machine may be busy)


def frame_port(address: str, swarm_key: bytes | None = None) -> int:
    """The framed port a server's Info announces (asked with a token in a private swarm)."""
    import grpc

    from swarmlm.swarm.private import AUTH_HEADER, make_token
    from swarmlm.wire import swarm_pb2_grpc as pb_grpc

    metadata = [(AUTH_HEADER, make_token(swarm_key, "/swarmlm.Swarm/Info"))] if swarm_key else None
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.SwarmStub(channel).Info(pb.InfoRequest(), timeout=TIMEOUT_S, metadata=metadata).frame_port


def exchange(host: str, port: int, data: bytes, half_close: bool = False) -> list[str]:
    """Send `data`, then read the server's frames: each as "REPLY", "STATUS CODE details", and a last "closed" when
    the connection ended without a STATUS. Half-closed: until the server closes (a connection may carry one stream
    after another); else until the first STATUS."""
    answers: list[str] = []
    with socket.create_connection((host, port), timeout=TIMEOUT_S) as sock:
        try:
            sock.sendall(data)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            return ["closed"]
        buf = b""
        while True:
            try:
                chunk = sock.recv(1 << 16)
            except OSError:
                chunk = b""
            buf += chunk
            while len(buf) >= HEADER.size:
                size, kind = HEADER.unpack(buf[:HEADER.size])
                if len(buf) < HEADER.size + size:
                    break
                body, buf = buf[HEADER.size:HEADER.size + size], buf[HEADER.size + size:]
                if kind == Kind.STATUS:
                    code, details = frames.parse_status(body)
                    answers.append(f"STATUS {code.name} {details}")
                    if not half_close:
                        return answers
                else:
                    answers.append(Kind(kind).name if kind in Kind._value2member_map_ else f"kind {kind}")
            if not chunk:
                return answers if answers and answers[-1].startswith("STATUS") else answers + ["closed"]


def open_request(blocks: int) -> bytes:
    request = pb.InferenceRequest(open=pb.OpenSession(start_block=0, end_block=blocks, batch_size=1, max_length=16))
    return frames.frame(Kind.REQUEST, request.SerializeToString())


def _step(hidden: int) -> bytes:
    request = pb.InferenceRequest(step=pb.InferenceStep(hidden=codec.encode(torch.randn(1, 1, hidden))))
    return frames.frame(Kind.REQUEST, request.SerializeToString())


def _push(rng: random.Random | None, hidden: int) -> bytes:
    """A PUSH frame: a parsable PushRequest into nobody's session (random ids and secrets when `rng` is given)."""
    pick = rng.randbytes if rng is not None else (lambda n: b"s" * n)
    request = pb.PushRequest(session_id=pick(16).hex(), secret=pick(16),
                             step=pb.InferenceStep(hidden=codec.encode(torch.randn(1, 1, hidden)),
                                                   step_id=rng.randint(0, 3) if rng is not None else 1),
                             mac=pick(16) if rng is None or rng.random() < 0.5 else b"")
    return frames.frame(Kind.PUSH, request.SerializeToString())


def _compact_head(step_id: int, b: int, t: int, h: int) -> bytes:
    from swarmlm.wire.compact import STEP_HEAD

    return STEP_HEAD.pack(step_id, b, t, h)


HELLO = frames.hello(Purpose.STREAM, None)
PUSH_HELLO = frames.hello(Purpose.PUSH, None)
END = frames.frame(Kind.END)


def cases(hidden: int, blocks: int, max_body_bytes: int) -> dict[str, bytes]:
    """Name -> the bytes a hostile peer sends (then it half-closes and reads)."""
    opened = HELLO + open_request(blocks)
    return {
        "garbage instead of a HELLO": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(256)),
        "wrong magic": frames.frame(Kind.HELLO, b"swarmlm-frame/1\n\x01"),
        "another wire protocol's HELLO": frames.frame(Kind.HELLO, b"swarmlm-frames/9\n\x01"),
        "unknown purpose": frames.frame(Kind.HELLO, frames.MAGIC + b"\x09"),
        "a REQUEST before HELLO": open_request(blocks),
        "oversized HELLO": HEADER.pack(1 << 20, Kind.HELLO),
        "oversized frame": HELLO + HEADER.pack(max_body_bytes + 1, Kind.REQUEST) + b"x" * 64,
        "unknown frame kind": HELLO + HEADER.pack(3, 200) + b"abc",
        "truncated header": HELLO + HEADER.pack(10, Kind.REQUEST)[:3],
        "truncated body": opened + HEADER.pack(4096, Kind.REQUEST) + b"x" * 100,
        "interleaved: a second HELLO mid-stream": opened + HELLO + _step(hidden),
        "interleaved: a REPLY from the client": opened + frames.frame(Kind.REPLY, b"") + _step(hidden),
        "interleaved: a PUSH inside a stream": opened + frames.frame(Kind.PUSH, b"\x0a\x01x"),
        "garbage REQUEST body": HELLO + frames.frame(Kind.REQUEST, bytes(range(256)) * 4),
        "garbage step in a session": opened + frames.frame(Kind.REQUEST, b"\xff" * 300) + frames.frame(Kind.END),
        "a REQUEST on a push connection": PUSH_HELLO + open_request(blocks),
        # pushes are answered as their frames arrive (server/frame_server.py `_push_now`): one STATUS each, in order,
        # then the frame that breaks the connection's rule is refused in its turn
        "pushes back to back, then a REQUEST": PUSH_HELLO + _push(None, hidden) * 3 + frames.frame(
            Kind.PUSH, b"\xff" * 40) + open_request(blocks),
        # a connection that carried a stream to its clean end (END, OK) takes another HELLO, and only that
        "garbage between streams": opened + END + b"GET / HTTP/1.1\r\n\r\n" + bytes(range(256)),
        "a REQUEST after a stream's end, no HELLO": opened + END + open_request(blocks),
        "a second stream sent before the first one's OK": opened + END + opened + END,
        "a new stream after a refused one": HELLO + _step(hidden) + opened + END,
        "a new stream after a broken frame": opened + HEADER.pack(4096, 200) + opened + END,
    }


def expected(name: str, answers: list[str]) -> bool:
    """Is this the clear refusal the case should get? Framing errors: a STATUS naming the problem (or, for a
    connection cut inside a frame, which the server cannot answer any more, a close)."""
    last = answers[-1] if answers else ""
    if name == "a second stream sent before the first one's OK":  # pipelined, not hostile: both served
        return answers == ["REPLY", "STATUS OK ", "REPLY", "STATUS OK "]
    if name in ("a new stream after a refused one", "a new stream after a broken frame"):  # never served
        return "REPLY" not in answers[1:] and (last == "closed" or last.startswith("STATUS INVALID_ARGUMENT"))
    if name in ("garbage between streams", "a REQUEST after a stream's end, no HELLO"):
        return answers[:2] == ["REPLY", "STATUS OK "] and last.startswith("STATUS INVALID_ARGUMENT") \
            and len(answers) == 3
    if name.startswith("truncated"):
        return last == "closed" or last.startswith("STATUS INVALID_ARGUMENT truncated")
    if name == "another wire protocol's HELLO":  # told so, with both numbers (wire/protocol.py)
        return last.startswith("STATUS INVALID_ARGUMENT the dialer speaks swarmlm wire protocol 9, this server")
    if name == "garbage REQUEST body":  # a message that does not parse: as on gRPC
        return last == "STATUS INVALID_ARGUMENT the message does not parse"
    if name == "pushes back to back, then a REQUEST":  # nobody's session (3x), a push that does not parse, then
        nobody = "STATUS NOT_FOUND no stream holds session " + repr("73" * 16)
        return len(answers) == 5 and all(a.startswith(nobody) for a in answers[:3]) and \
            answers[3] == "STATUS INVALID_ARGUMENT the request does not parse" and \
            answers[4].startswith("STATUS INVALID_ARGUMENT a REQUEST frame on a push connection")
    if name == "garbage step in a session":  # the open's reply, the step's refusal (a REPLY with an error), OK
        return answers == ["REPLY", "REPLY", "STATUS OK "]
    return last.startswith("STATUS INVALID_ARGUMENT") and len(last) > len("STATUS INVALID_ARGUMENT ") + 10


def run_cases(address: str, hidden: int, blocks: int, max_body_bytes: int) -> dict[str, list[str]]:
    host, port = address.rsplit(":", 1)[0], frame_port(address)
    return {name: exchange(host, port, data, half_close=True)
            for name, data in cases(hidden, blocks, max_body_bytes).items()}


def random_frames(rng: random.Random, hidden: int, blocks: int) -> bytes:
    """A fuzzer's connection: a HELLO (or not), then random frames, random bytes, and valid ones mixed (a stream's
    END and the next stream's HELLO among them: a connection carries one stream after another)."""
    pushing = rng.random() >= 0.8 and rng.random() < 0.5
    out = PUSH_HELLO if pushing else HELLO if rng.random() < 0.8 else b""
    for _ in range(rng.randint(0, 5)):
        pick = rng.random()
        if pushing and pick < 0.4:  # (pushes: taken as they arrive, server/frame_server.py `_push_now`)
            out += _push(rng, hidden)
        elif pick < 0.25:
            out += open_request(blocks)
        elif pick < 0.3:
            out += _step(hidden)
        elif pick < 0.35:  # a compact STEP of plausible dims (wire/compact.py), its MAC random: no session is keyed
            out += frames.frame(Kind.STEP, _compact_head(rng.randint(0, 3), 1, 1, hidden) +
                                rng.randbytes(hidden * 4 + 16 + rng.choice([0, 0, -4, 4])))
        elif pick < 0.45:  # the stream's end and the connection's next stream (or not: a HELLO out of turn)
            out += END + (HELLO if rng.random() < 0.8 else b"") if rng.random() < 0.7 else HELLO
        elif pick < 0.6:
            out += frames.frame(rng.choice(list(Kind)), rng.randbytes(rng.randint(0, 300)))
        elif pick < 0.75:
            out += HEADER.pack(rng.choice([0, 1, 100, 1 << 20, (1 << 32) - 1]), rng.randint(0, 255))
        else:
            out += rng.randbytes(rng.randint(0, 200))
    return out


# ---- compact decode frames (wire/compact.py): hostile STEPs in a keyed session ----------------------------------

class KeyedStream:
    """A keyed session of blocks [start, blocks) opened on a server's framed port with a blocking socket, as a
    client would (its key share from the server's Info), for hostile STEP frames: `step` and `request` write one and
    read the answer, `exchange` writes bytes, half-closes and reads every frame until the server closes."""

    def __init__(self, address: str, blocks: int, batch: int = 1, max_length: int = 16, start: int = 0) -> None:
        import grpc

        from swarmlm.wire import session_keys
        from swarmlm.wire import swarm_pb2_grpc as pb_grpc

        with grpc.insecure_channel(address) as channel:
            info = pb_grpc.SwarmStub(channel).Info(pb.InfoRequest(), timeout=TIMEOUT_S)
        share, self.keys = session_keys.client_keys(info.key_share)
        self.sock = socket.create_connection((address.rsplit(":", 1)[0], info.frame_port), timeout=TIMEOUT_S)
        self._buf = bytearray()
        opened = session_keys.sign(self.keys.client, "", pb.InferenceRequest(open=pb.OpenSession(
            start_block=start, end_block=blocks, batch_size=batch, max_length=max_length, key_share=share)))
        self.send(HELLO + frames.frame(Kind.REQUEST, opened.SerializeToString()))
        kind, body = self.frame() or (None, b"")
        if kind != Kind.REPLY:
            raise RuntimeError(f"the open was not answered by a reply: {kind and kind.name} {body[:300]!r}")
        reply = pb.InferenceReply.FromString(body)
        if not session_keys.verified(self.keys.server, reply.session_id, reply):
            raise RuntimeError(f"the open's reply does not carry the server key's MAC: {reply}")
        self.session_id = reply.session_id
        self.secret = reply.session_secret  # (a push into this session carries it)
        self.next_id = 1  # the step id a case's STEP carries (after `warm`, the next one)

    def warm(self, hidden: int) -> None:
        """A prompt of 2 tokens, then 3 decode STEPs answered (ids 1-3): on a server where this session is alone, its
        step lane is armed from the second one on (server/lane.py), and the next frames meet the lane first."""
        import numpy as np

        rng = np.random.default_rng(3)
        self.request(rng.standard_normal((1, 2, hidden), dtype=np.float32), 0)
        for step_id in (1, 2, 3):
            answer = self.step(rng.standard_normal((1, 1, hidden), dtype=np.float32), step_id)
            if isinstance(answer, pb.InferenceReply) or answer.position != 2 + step_id:
                raise RuntimeError(f"warming step {step_id} was not answered by an ANSWER: {answer}")
        self.next_id = 4

    @classmethod
    def plain(cls, host: str, port: int) -> "KeyedStream":
        """A connection without a HELLO or session yet (for `exchange`: its answers read as a keyed stream's)."""
        stream = cls.__new__(cls)
        stream.sock = socket.create_connection((host, port), timeout=TIMEOUT_S)
        stream._buf = bytearray()
        return stream

    def __enter__(self) -> "KeyedStream":
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def frame(self) -> tuple[Kind, bytes] | None:
        """The server's next frame; None when it closed."""
        while (got := frames.parse_frame(self._buf, 1 << 26)) is None:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                return None
            self._buf += chunk
        return got

    def step_frame(self, values, step_id: int, dims: tuple[int, int, int] | None = None) -> bytes:
        """A STEP frame of `values` ([B, T, H] float32), MACed under the session's client key (`dims`: what its
        header claims, default the values' own)."""
        from swarmlm.wire import compact

        b, t, h = dims or values.shape
        return compact.step_frame(self.keys.client, self.session_id, step_id, b, t, h, values.tobytes())

    def answer(self):
        """The next answer: an ANSWER checked under the server key (`compact.Answer`), else a signed REPLY."""
        from swarmlm.wire import compact, session_keys

        kind, body = self.frame()
        if kind == Kind.ANSWER:
            answer = compact.Answer(body)
            size = len(body) - compact.ANSWER_HEAD.size - len(body[-16:])
            return answer.opened(self.keys.server, self.session_id, size // 4)
        if kind != Kind.REPLY:
            raise RuntimeError(f"a {kind.name} frame: {body[:200]!r}")
        reply = pb.InferenceReply.FromString(body)
        if not session_keys.verified(self.keys.server, self.session_id, reply):
            raise RuntimeError("a reply without the server key's MAC")
        return reply

    def step(self, values, step_id: int):
        self.send(self.step_frame(values, step_id))
        return self.answer()

    def request(self, values, step_id: int) -> pb.InferenceReply:
        """A protobuf step of `values`, signed."""
        from swarmlm.wire import session_keys

        request = session_keys.sign(self.keys.client, self.session_id, pb.InferenceRequest(step=pb.InferenceStep(
            hidden=codec.encode(torch.from_numpy(values)), step_id=step_id)))
        self.send(frames.frame(Kind.REQUEST, request.SerializeToString()))
        return self.answer()

    def exchange(self, data: bytes) -> list[str]:
        """Send `data`, half-close, then every frame until the server closes: "ANSWER", "REPLY" (+ " " and its
        error, if refused), "STATUS CODE details", and "closed" when it closed without a STATUS."""
        answers: list[str] = []
        try:
            self.send(data)
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            return ["closed"]
        while True:
            try:
                got = self.frame()
            except OSError:
                got = None
            if got is None:
                return answers if answers and answers[-1].startswith("STATUS") else answers + ["closed"]
            kind, body = got
            if kind == Kind.STATUS:
                code, details = frames.parse_status(body)
                answers.append(f"STATUS {code.name} {details}")
            elif kind == Kind.REFUSED:
                step_id, code, details = frames.parse_refused(body)
                answers.append(f"REFUSED {step_id} {code.name} {details}")
            elif kind == Kind.REPLY:
                error = pb.InferenceReply.FromString(body).error.message
                answers.append(f"REPLY {error}" if error else "REPLY")
            else:
                answers.append(kind.name)


def _values(b: int, t: int, hidden: int, fill: float | None = None):
    import numpy as np

    values = np.random.default_rng(b * 100 + t).standard_normal((b, t, hidden), dtype=np.float32)
    if fill is not None:
        values[0, 0, hidden // 2] = fill
    return values


def compact_cases(hidden: int, max_batch: int = 64) -> dict[str, object]:
    """Name -> a hostile STEP case: the bytes sent on a plain connection, or a function of a `KeyedStream` giving the
    bytes sent after its open (then END; the stream half-closes and reads)."""
    from swarmlm.wire import compact
    from swarmlm.wire.session_keys import MAC_BYTES, _mac_of

    def mac_flipped(s: KeyedStream) -> bytes:
        frame = bytearray(s.step_frame(_values(1, 1, hidden), s.next_id))
        frame[-1] ^= 1
        return bytes(frame)

    def protobuf_domain(s: KeyedStream) -> bytes:  # the right key, the protobuf messages' MAC (no personalisation)
        frame = s.step_frame(_values(1, 1, hidden), s.next_id)[:-MAC_BYTES]
        return frame + _mac_of(s.keys.client, s.session_id, frame[HEADER.size:])

    def recut(frame: bytes, body_bytes: int) -> bytes:  # the frame's body cut to `body_bytes`, its header to match
        return HEADER.pack(body_bytes, Kind.STEP) + frame[HEADER.size:HEADER.size + body_bytes]

    one = compact.STEP_HEAD.size + hidden * 4 + MAC_BYTES
    step = b"\x00" * compact.STEP_HEAD.size + b"\x00" * hidden * 4 + b"\x00" * MAC_BYTES
    return {
        "STEP before the session is open": HELLO + frames.frame(Kind.STEP, step),
        "STEP on a push connection": PUSH_HELLO + frames.frame(Kind.STEP, step),
        "STEP oversized": HELLO + HEADER.pack((1 << 32) - 1, Kind.STEP) + b"x" * 64,
        "STEP truncated (header only)": lambda s: recut(s.step_frame(_values(1, 1, hidden), s.next_id), 10),
        "STEP without its MAC": lambda s: recut(s.step_frame(_values(1, 1, hidden), s.next_id), one - MAC_BYTES),
        "STEP with a changed MAC": mac_flipped,
        "STEP MACed as a protobuf message": protobuf_domain,
        "STEP of the wrong length for its dims":
            lambda s: s.step_frame(_values(1, 1, hidden), s.next_id, dims=(1, 2, hidden)),
        "STEP over the session's batch": lambda s: s.step_frame(_values(2, 1, hidden), s.next_id),  # (opened with 1)
        "STEP over the server's max_batch": lambda s: s.step_frame(_values(max_batch + 1, 1, hidden), s.next_id),
        "STEP over the session's max_length": lambda s: s.step_frame(_values(1, 17, hidden), s.next_id),
        "STEP of another hidden size": lambda s: s.step_frame(_values(1, 1, hidden + 1), s.next_id),
        "STEP of an unkeyed session": HELLO + open_request(1) + frames.frame(
            Kind.STEP, compact.step_frame(b"k" * 32, "", 1, 1, 1, hidden, _values(1, 1, hidden).tobytes())[
                HEADER.size:]) + END,
        "STEP with NaN": lambda s: s.step_frame(_values(1, 1, hidden, float("nan")), s.next_id),
        "STEP with inf": lambda s: s.step_frame(_values(1, 1, hidden, float("inf")), s.next_id),
        "STEP replayed": lambda s: s.step_frame(_values(1, 1, hidden), s.next_id) * 2,
        "ANSWER sent by a client": lambda s: compact.answer_frame(
            s.keys.client, s.session_id, s.next_id, 1, _values(1, 1, hidden).tobytes(), 0.0, 0.0, 0.0, 0.0, 1),
    }


def compact_expected(name: str, answers: list[str]) -> bool:
    """Is this the clear answer the compact case should get?"""
    last = answers[-1] if answers else ""
    if name in ("STEP truncated (header only)", "STEP without its MAC", "STEP with a changed MAC",
                "STEP MACed as a protobuf message"):  # as a tampered protobuf step: the session closed
        return answers == ["STATUS PERMISSION_DENIED a message's MAC does not match the session's key (changed on "
                           "the way): session closed"]
    stepped = "does not match the session's batch 1"  # (its rows, once it has stepped: `KeyedStream.warm`)
    refusals = {"STEP of the wrong length for its dims": ("do not match its dims",),
                "STEP over the session's batch": ("rows exceed the batch of 1 reserved at open", stepped),
                "STEP over the server's max_batch": ("exceeds the limit of", stepped),
                "STEP over the session's max_length": ("would exceed the max_length 16",),
                "STEP of another hidden size": ("does not match the model's",),
                "STEP with NaN": ("contains NaN or infinite values",),
                "STEP with inf": ("contains NaN or infinite values",)}
    if name == "STEP of an unkeyed session":  # the open's reply, the refusal, the clean end
        return answers[0] == "REPLY" and answers[1:] == ["REPLY a compact STEP needs a keyed session", "STATUS OK "]
    if name in refusals:  # a REPLY with the error; the session goes on to its clean end
        return len(answers) == 2 and answers[0].startswith("REPLY ") and \
            any(words in answers[0] for words in refusals[name]) and answers[1] == "STATUS OK "
    if name == "STEP replayed":  # one answer: the copy is StepOrder's duplicate, dropped
        return answers == ["ANSWER", "STATUS OK "]
    wants = {"STEP before the session is open": "a compact STEP before a session is open",
             "STEP on a push connection": "a STEP frame on a push connection",
             "STEP oversized": "oversized frame",
             "ANSWER sent by a client": "a ANSWER frame inside a stream"}
    return last.startswith("STATUS INVALID_ARGUMENT " + wants[name])


def run_compact_cases(address: str, hidden: int, blocks: int, max_batch: int = 64,
                      warm: bool = False) -> dict[str, list[str]]:
    """Each compact case on a connection (and a keyed session) of its own: what the server answered. `warm`: each
    session decodes a few steps first (`KeyedStream.warm`: a lone session's step lane is then armed)."""
    host, port = address.rsplit(":", 1)[0], frame_port(address)
    results = {}
    for name, case in compact_cases(hidden, max_batch).items():
        if isinstance(case, bytes):
            with KeyedStream.plain(host, port) as stream:
                results[name] = stream.exchange(case)
            continue
        with KeyedStream(address, blocks) as stream:
            if warm:
                stream.warm(hidden)
            results[name] = stream.exchange(case(stream) + END)
    return results


# ---- compact pushes (wire/compact.py PUSH_STEP): hostile pushes into a keyed session ----------------------------

def push_cases(hidden: int) -> dict[str, object]:
    """Name -> a function of a `KeyedStream` (its session open) giving the frames a push connection sends after its
    HELLO; the connection then half-closes and reads every STATUS, and the session's stream is ended and read
    (`run_push_cases`)."""
    from swarmlm.wire import compact
    from swarmlm.wire.session_keys import MAC_BYTES, _mac_of

    def push(s: KeyedStream, step_id: int = 1, values=None, key: bytes | None = None, secret: bytes | None = None,
             session_id: str | None = None, dims: tuple[int, int, int] | None = None) -> bytes:
        values = _values(1, 1, hidden) if values is None else values
        b, t, h = dims or values.shape
        return compact.push_frame(s.keys.push if key is None else key, s.session_id if session_id is None else
                                  session_id, s.secret if secret is None else secret, step_id, b, t, h,
                                  values.tobytes())

    def remaced(frame: bytes, session_id: str, mac) -> bytes:  # the frame's MAC replaced by mac(body before it)
        body = frame[HEADER.size:-MAC_BYTES]
        return frame[:-MAC_BYTES] + mac(body)

    def recut(frame: bytes, body_bytes: int) -> bytes:
        return HEADER.pack(body_bytes, Kind.PUSH_STEP) + frame[HEADER.size:HEADER.size + body_bytes]

    def flipped(frame: bytes, at: int) -> bytes:
        changed = bytearray(frame)
        changed[at] ^= 1
        return bytes(changed)

    def protobuf_push(s: KeyedStream, step_id: int, keep_route: bool = False) -> bytes:
        from swarmlm.wire import session_keys
        request = pb.PushRequest(session_id=s.session_id, secret=s.secret, step=pb.InferenceStep(
            hidden=codec.encode(torch.from_numpy(_values(1, 1, hidden))), step_id=step_id, keep_route=keep_route))
        return frames.frame(Kind.PUSH, session_keys.signed_bytes(s.keys.push, s.session_id, request))

    def step_domain(s: KeyedStream) -> bytes:  # the push key, a STEP's personalisation
        return remaced(push(s), s.session_id, lambda body: compact._tag(s.keys.push, compact._STEP_PERSON,
                                                                        s.session_id, body))

    return {
        "PUSH_STEP honest": lambda s: push(s),
        "PUSH_STEP truncated (header only)": lambda s: recut(push(s), 10),
        "PUSH_STEP without its MAC": lambda s: recut(push(s), len(push(s)) - HEADER.size - MAC_BYTES),
        "PUSH_STEP oversized": lambda s: HEADER.pack((1 << 32) - 1, Kind.PUSH_STEP) + b"x" * 64,
        "PUSH_STEP with a changed MAC": lambda s: flipped(push(s), -1),
        "PUSH_STEP with a changed value": lambda s: flipped(push(s), -MAC_BYTES - 1),
        "PUSH_STEP MACed as a STEP": step_domain,
        "PUSH_STEP MACed as a protobuf message": lambda s: remaced(
            push(s), s.session_id, lambda body: _mac_of(s.keys.push, s.session_id, body)),
        "PUSH_STEP under the client key": lambda s: push(s, key=s.keys.client),
        "PUSH_STEP with the wrong secret": lambda s: push(s, secret=b"w" * 16),
        "PUSH_STEP into an unknown session": lambda s: push(s, session_id="f" * 32),
        "PUSH_STEP replayed": lambda s: push(s) * 2,
        "PUSH_STEP interleaved with a PUSH": lambda s: push(s, 1) + protobuf_push(s, 2) + push(s, 3),
        "PUSH_STEP with NaN": lambda s: push(s, values=_values(1, 1, hidden, float("nan"))),
        "PUSH_STEP of the wrong length for its dims": lambda s: push(s, dims=(1, 2, hidden)),
        "PUSH_STEP of another hidden size": lambda s: push(s, values=_values(1, 1, hidden + 1)),
        "PUSH_STEP of step id 0": lambda s: push(s, 0),
        "PUSH_STEP inside a stream": "stream",
        # (protocol 4: a push on a route its taker keeps, into a session that keeps none)
        "PUSH on a route not kept": lambda s: protobuf_push(s, 1, keep_route=True),
    }


def push_expected(name: str, answers: list[str], stream: list[str]) -> bool:
    """Is this the clear answer the push case should get? `answers`: the push connection's, `stream`: the session's
    stream's after its END."""
    # an accepted PUSH_STEP is not answered; a refused one gets a REFUSED naming its step (the cases push step 1)
    denied = "REFUSED 1 PERMISSION_DENIED a PUSH_STEP must carry its keyed session's push key MAC (missing or wrong)"
    untouched = stream == ["STATUS OK "]  # the session took nothing from it and ended cleanly
    if name == "PUSH_STEP honest":
        return answers == [] and stream == ["ANSWER", "STATUS OK "]
    if name == "PUSH_STEP replayed":  # both taken, the copy dropped by the session's step order: one answer
        return answers == [] and stream == ["ANSWER", "STATUS OK "]
    if name == "PUSH_STEP interleaved with a PUSH":  # (the PUSH's STATUS, always)
        return answers == ["STATUS OK "] and stream == ["ANSWER", "REPLY", "ANSWER", "STATUS OK "]
    if name in ("PUSH_STEP without its MAC", "PUSH_STEP with a changed MAC", "PUSH_STEP with a changed value",
                "PUSH_STEP MACed as a STEP", "PUSH_STEP MACed as a protobuf message", "PUSH_STEP under the client key"):
        return answers == [denied] and untouched
    if name == "PUSH_STEP with the wrong secret":
        return answers == ["REFUSED 1 PERMISSION_DENIED a push must carry the session's secret"] and untouched
    if name == "PUSH_STEP into an unknown session":
        return len(answers) == 1 and answers[0].startswith("REFUSED 1 NOT_FOUND no stream holds session") \
            and untouched
    if name == "PUSH_STEP truncated (header only)":  # too short for its step id too: it names step 0
        return len(answers) == 1 and answers[0].startswith("REFUSED 0 NOT_FOUND no stream holds session") \
            and untouched
    if name == "PUSH_STEP of step id 0":
        return answers == ["REFUSED 0 INVALID_ARGUMENT a pushed step needs a nonzero step id"] and untouched
    if name == "PUSH_STEP oversized":
        return answers[-1].startswith("STATUS INVALID_ARGUMENT oversized frame") and untouched
    if name == "PUSH_STEP inside a stream":  # on the session's own stream: the stream breaks
        return answers == [] and stream[-1].startswith("STATUS INVALID_ARGUMENT a PUSH_STEP frame inside a stream")
    if name == "PUSH on a route not kept":  # taken (a PUSH's STATUS), refused by its step: the session goes on
        return answers == ["STATUS OK "] and len(stream) == 2 and stream[1] == "STATUS OK " and \
            stream[0] == "REPLY keep_route without push targets: no route is kept for this session's steps from its " \
            "pushes"
    refusals = {"PUSH_STEP with NaN": "contains NaN or infinite values",
                "PUSH_STEP of the wrong length for its dims": "do not match its dims",
                "PUSH_STEP of another hidden size": "does not match the model's"}
    # taken (the pusher cannot know), then refused by the session's step: a REPLY with the error, the session goes on
    return answers == [] and len(stream) == 2 and stream[0].startswith("REPLY ") \
        and refusals[name] in stream[0] and stream[1] == "STATUS OK "


def run_push_cases(address: str, hidden: int, blocks: int) -> dict[str, tuple[list[str], list[str]]]:
    """Each push case into a keyed session of its own: (the push connection's answers, the session stream's)."""
    host, port = address.rsplit(":", 1)[0], frame_port(address)
    results = {}
    for name, case in push_cases(hidden).items():
        with KeyedStream(address, blocks) as stream:
            if case == "stream":
                results[name] = ([], stream.exchange(push_cases(hidden)["PUSH_STEP honest"](stream)))
                continue
            with KeyedStream.plain(host, port) as pusher:
                answers = pusher.exchange(PUSH_HELLO + case(stream))
            if answers and answers[-1] == "closed":  # a push connection ends without a word of its own
                answers = answers[:-1]
            results[name] = (answers, stream.exchange(END))
    return results
