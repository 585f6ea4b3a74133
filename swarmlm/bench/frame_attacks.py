"""Hostile frames against a server's framed step port (wire/frames.py), light in tests/test_attacks.py and
tests/test_fuzz_rpc.py, heavy in benchmarks/attacks.py. Each case opens its own connection with a blocking socket
and returns what the server answered: "STATUS <CODE> <details>", "REPLY ..." or "closed" (it closed without a
word: a connection cut inside a frame cannot be answered)."""
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
        elif pick < 0.35:
            out += _step(hidden)
        elif pick < 0.45:  # the stream's end and the connection's next stream (or not: a HELLO out of turn)
            out += END + (HELLO if rng.random() < 0.8 else b"") if rng.random() < 0.7 else HELLO
        elif pick < 0.6:
            out += frames.frame(rng.choice(list(Kind)), rng.randbytes(rng.randint(0, 300)))
        elif pick < 0.75:
            out += HEADER.pack(rng.choice([0, 1, 100, 1 << 20, (1 << 32) - 1]), rng.randint(0, 255))
        else:
            out += rng.randbytes(rng.randint(0, 200))
    return out
