"""What a decode hop's own message work costs with nothing else around it (issue 40): the lower bound for a Python
hop on this machine, to hold `hop_breakdown.py`'s per-hop overhead against.

    .venv/bin/python benchmarks/hop_lean.py [--compute-ms 0,2,17,60] [--hidden 1024] [--steps 40]
                                            [--wires protobuf,bare]

A client and a "server" process on loopback, blocking sockets, one thread each, no event loop, no session, no
scheduler: per step the client builds a real `InferenceRequest` (the hidden state through `codec.encode`, keyed
MAC), frames and sends it; the server parses it, checks its MAC, decodes it with the finiteness check, "computes"
(sweeps a 256 MiB buffer for --compute-ms, as a forward evicts the caches), then encodes, MACs, serialises and sends
an `InferenceReply` with its compute time; the client parses, checks and decodes it. Per hop = the client's step
wall time minus the server's compute (hop_breakdown's measure). Medians over --steps steps after 5 warm-up steps.

--wires: `protobuf` is the product's message work as above; `bare` the least a checked message can cost in Python
(a fixed struct + raw float32 + the keyed BLAKE2b tag, the finiteness check in numpy; no protobuf, no torch): what
Python alone costs on this VM, whatever the wire format; `compact` the product's compact decode frames (STEP /
ANSWER, wire/compact.py) with the server's checks and torch tensors on both ends. Every wire's messages go as
frames (wire/frames.py: 4 bytes length, 1 byte kind).
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
import math
import os
import socket
import statistics
import struct
import time

import numpy as np
import torch

from swarmlm.config import ServerConfig
from swarmlm.machine import machine_line
from swarmlm.server.checks import StepChecks
from swarmlm.types import BlockRange
from swarmlm.wire import codec, compact, frames
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire.session_keys import MAC_BYTES, sign, verified

KEY, SESSION = b"k" * 32, "s" * 32
WARM_UP = 5


def _exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        r = sock.recv_into(view[got:])
        if not r:
            raise EOFError
        got += r
    return bytes(buf)


def _frame(sock: socket.socket) -> bytes:
    """A frame's body (wire/frames.py: 4 bytes length, 1 byte kind, the body)."""
    return _exact(sock, frames.HEADER.unpack(_exact(sock, frames.HEADER.size))[0])


def _send(sock: socket.socket, data: bytes, framed: bool) -> None:
    """`data` as a frame (a compact wire's messages are whole frames already)."""
    sock.sendall(data if framed else frames.frame(frames.Kind.REQUEST, data))


class ProtobufWire:
    """The product's message work: protobuf messages, the codec (torch tensors, finiteness check), keyed MAC."""

    @staticmethod
    def sample(hidden_size: int) -> torch.Tensor:
        return torch.randn(1, 1, hidden_size)

    @staticmethod
    def request(hidden: torch.Tensor, step_id: int) -> bytes:
        return sign(KEY, SESSION, pb.InferenceRequest(session_id=SESSION, step=pb.InferenceStep(
            hidden=codec.encode(hidden), step_id=step_id))).SerializeToString()

    @staticmethod
    def parse_request(body: bytes) -> tuple[int, torch.Tensor]:
        request = pb.InferenceRequest.FromString(body)
        if not verified(KEY, SESSION, request):
            raise ValueError("MAC mismatch")
        return request.step.step_id, codec.decode(request.step.hidden, finite=True)

    @staticmethod
    def reply(hidden: torch.Tensor, step_id: int, compute_s: float) -> bytes:
        return sign(KEY, SESSION, pb.InferenceReply(
            session_id=SESSION, hidden=codec.encode(hidden * 1.0), step_id=step_id, position=1,
            timing=pb.Timing(compute_s=compute_s))).SerializeToString()

    @staticmethod
    def parse_reply(body: bytes) -> float:
        reply = pb.InferenceReply.FromString(body)
        if not verified(KEY, SESSION, reply):
            raise ValueError("MAC mismatch")
        codec.decode(reply.hidden, finite=True)
        return reply.timing.compute_s


class BareWire:
    """The least a checked message can cost in Python: a fixed struct (step id or compute time) + raw float32 + a
    keyed BLAKE2b tag, the finiteness check in numpy; no protobuf, no torch."""

    HEAD = struct.Struct("<Qd")  # step id, compute seconds

    @staticmethod
    def sample(hidden_size: int) -> np.ndarray:
        return np.random.default_rng(0).standard_normal(hidden_size, dtype=np.float32)

    @classmethod
    def _sealed(cls, head: bytes, hidden: np.ndarray) -> bytes:
        body = head + hidden.tobytes()
        return body + _tag(body)

    @classmethod
    def _opened(cls, body: bytes) -> tuple[tuple, np.ndarray]:
        data, tag = body[:-MAC_BYTES], body[-MAC_BYTES:]
        if not hmac.compare_digest(tag, _tag(data)):
            raise ValueError("MAC mismatch")
        values = np.frombuffer(data, dtype=np.float32, offset=cls.HEAD.size)
        if math.isnan(values.dot(np.zeros(values.size, np.float32))):
            raise ValueError("not finite")
        return cls.HEAD.unpack_from(data), values.copy()

    @classmethod
    def request(cls, hidden: np.ndarray, step_id: int) -> bytes:
        return cls._sealed(cls.HEAD.pack(step_id, 0.0), hidden)

    @classmethod
    def parse_request(cls, body: bytes) -> tuple[int, np.ndarray]:
        (step_id, _), values = cls._opened(body)
        return step_id, values

    @classmethod
    def reply(cls, hidden: np.ndarray, step_id: int, compute_s: float) -> bytes:
        return cls._sealed(cls.HEAD.pack(step_id, compute_s), hidden * 1.0)

    @classmethod
    def parse_reply(cls, body: bytes) -> float:
        (_, compute_s), _ = cls._opened(body)
        return compute_s


class CompactWire:
    """The product's compact decode frames (wire/compact.py): STEP and ANSWER, a fixed struct + raw float32 + a
    personalised keyed BLAKE2b tag, the server's dims and length checks, the finiteness check in numpy, torch
    tensors on both ends (from_numpy / .numpy()): what the client's `send_blocking` / `_answer` and the server's
    `_step` do with a plain decode step."""

    FRAMED = True  # its messages are whole frames

    @staticmethod
    def sample(hidden_size: int) -> torch.Tensor:
        return torch.randn(1, 1, hidden_size)

    @staticmethod
    def request(hidden: torch.Tensor, step_id: int) -> bytes:
        b, t, h = hidden.shape
        return compact.step_frame(KEY, SESSION, step_id, b, t, h, compact.float32_values(hidden))

    @staticmethod
    def parse_request(body: bytes) -> tuple[int, torch.Tensor]:
        step = compact.CompactStep(body)
        if not step.verified(KEY, SESSION):
            raise ValueError("MAC mismatch")
        b, t = CHECKS.dims(step.b, step.t, step.h, 1, 0, 2048)
        return step.step_id, codec.tensor_of(step.values(), (b, t, step.h), "hidden", finite=True)

    @staticmethod
    def reply(hidden: torch.Tensor, step_id: int, compute_s: float) -> bytes:
        return compact.answer_frame(KEY, SESSION, step_id, 1, compact.float32_values(hidden * 1.0), 0.0, compute_s,
                                    0.0, 0.0, 1)

    @staticmethod
    def parse_reply(body: bytes) -> float:
        answer = compact.Answer(body).opened(KEY, SESSION, CHECKS.hidden_size)
        codec.tensor_of(np.frombuffer(answer.data(), dtype=np.float32), (1, 1, CHECKS.hidden_size))
        return answer.compute_s


CHECKS: StepChecks | None = None  # the server's limits (set per run)
WIRES = {"protobuf": ProtobufWire, "bare": BareWire, "compact": CompactWire}


def _tag(data: bytes) -> bytes:
    digest = hashlib.blake2b(SESSION.encode() + b"\n", digest_size=MAC_BYTES, key=KEY)
    digest.update(data)
    return digest.digest()


def _serve(sock: socket.socket, compute_s: float, wire) -> None:
    """The server's loop, until the client closes."""
    big = np.ones(64 << 20, dtype=np.float32)  # 256 MiB: what a forward's weights do to the caches
    while True:
        try:
            body = _frame(sock)
        except EOFError:
            return
        step_id, hidden = wire.parse_request(body)
        started = time.perf_counter()
        while time.perf_counter() - started < compute_s:
            big[::16].sum()
        _send(sock, wire.reply(hidden, step_id, time.perf_counter() - started), getattr(wire, "FRAMED", False))


def lean_hop(compute_ms: float, hidden_size: int, steps: int, wire=ProtobufWire) -> dict[str, float]:
    """Medians in ms: the per-hop overhead, and the client's own work before and after the wire."""
    global CHECKS
    CHECKS = StepChecks(ServerConfig("", BlockRange(0, 1)), BlockRange(0, 1), hidden_size)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    pid = os.fork()
    if pid == 0:  # the server
        torch.set_num_threads(1)
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            _serve(conn, compute_ms / 1000, wire)
        finally:
            os._exit(0)
    listener_port = listener.getsockname()[1]
    listener.close()
    sock = socket.create_connection(("127.0.0.1", listener_port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    x = wire.sample(hidden_size)
    rows = []
    try:
        for i in range(steps + WARM_UP):
            t0 = time.perf_counter()
            _send(sock, wire.request(x, i + 1), getattr(wire, "FRAMED", False))
            t1 = time.perf_counter()
            body = _frame(sock)
            t2 = time.perf_counter()
            compute_s = wire.parse_reply(body)
            t3 = time.perf_counter()
            if i >= WARM_UP:
                rows.append({"per hop (step - compute)": t3 - t0 - compute_s,
                             "client: build + send": t1 - t0, "client: parse + verify + decode": t3 - t2})
    finally:
        sock.close()
        os.waitpid(pid, 0)
    return {k: statistics.median(r[k] for r in rows) * 1000 for k in rows[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compute-ms", default="0,2,17,60", help="the server's compute per step, comma-separated")
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size (bloomz-560m 1024, tiny-bloom 64)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--wires", default="protobuf,bare", help=f"comma-separated, of {', '.join(WIRES)}")
    args = ap.parse_args()
    wires = [WIRES[name] for name in args.wires.split(",")]
    torch.set_num_threads(1)
    print("machine:", machine_line(), flush=True)
    print("load average (1, 5, 15 min) at start:", *os.getloadavg(), flush=True)
    for compute_ms in (float(c) for c in args.compute_ms.split(",")):
        for wire in wires:
            parts = lean_hop(compute_ms, args.hidden, args.steps, wire)
            print(f"{wire.__name__}, compute {compute_ms:g} ms, hidden {args.hidden}: " +
                  ", ".join(f"{k} {v:.3f}" for k, v in parts.items()) + " (ms, medians)", flush=True)
    print("load average (1, 5, 15 min) at end:", *os.getloadavg(), flush=True)


if __name__ == "__main__":
    main()
