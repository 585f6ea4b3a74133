"""A user-space delaying TCP relay: the kernel here has no netem, so delay and jitter are added in user space.

One relay process serves many listeners. Each accepted connection is forwarded to the listener's target;
every byte is held for the one-way delay of its direction before it is written on, in order. Optionally the
relay also serializes at a link rate (when tc/tbf cannot) and turns loss into retransmission delay.
It is just bytes: TLS, HTTP/2 and gRPC streams pass through unchanged.

Why threads and not asyncio: asyncio's epoll timeouts are rounded up to whole milliseconds, which would
double a 0.5 ms one-way delay; `time.sleep` (clock_nanosleep) with a 1 us timer slack plus a short final
spin keeps each release within tens of microseconds. Each direction of a connection has a reader thread
(recv, stamp, queue) and a writer thread (wait for the release time, send), so delayed bytes are pipelined.
The delay runs from the kernel's receive timestamp, so the reader's wake-up is not added to it; the send
and the receiver's wake-up are (the Testbed measures that base cost of its path and subtracts it).

Run as a child process (`RelayProcess`) so it never competes with the benchmark client's GIL. It is
controlled by JSON lines on stdin and exits when stdin closes, so it cannot outlive its parent.
"""
from __future__ import annotations

import collections
import ctypes
import dataclasses
import json
import math
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

from swarmlm.bench.netem.profile import GOODPUT_PER_LINE_RATE

_SPIN_S = 150e-6  # the last part of a wait is spun (yielding the GIL): short sleeps overshoot by ~40-150 us
_MSS_BYTES = 1448  # loss is drawn per packet of this size
_WIRE_PER_PAYLOAD = 1 / GOODPUT_PER_LINE_RATE  # headers per full segment, counted as tbf counts them
_SO_TIMESTAMPNS = _SCM_TIMESTAMPNS = 35  # Linux; not exported by the socket module
_ANCILLARY_BYTES = socket.CMSG_SPACE(16)  # one struct timespec
_NICE = -10  # the relay's scheduling priority when the process may raise it (root)
_PR_SET_PDEATHSIG = 1
_PR_SET_TIMERSLACK = 29


@dataclass(frozen=True)
class DirectionSpec:
    """What the relay adds to one direction of a connection."""

    delay_s: float  # one-way delay added to every byte
    jitter_s: float = 0.0  # delay is uniform in [delay_s - jitter_s, delay_s + jitter_s]; order is kept
    rate_bps: float | None = None  # serialize at this rate here; None when tbf already limits (or unlimited)
    loss: float = 0.0  # per-packet loss probability; a chunk with a lost packet waits `retransmit_s` more
    retransmit_s: float = 0.0  # extra delay of a retransmission (about one RTT: fast retransmit)
    link_id: str = ""  # directions with the same id share one serializer, as flows share a real link

    def __post_init__(self) -> None:
        if self.delay_s < 0 or self.jitter_s < 0 or self.retransmit_s < 0:
            raise ValueError(f"negative delay in {self}")
        if self.jitter_s > self.delay_s:
            raise ValueError(f"jitter_s={self.jitter_s} exceeds delay_s={self.delay_s}")
        if self.rate_bps is not None and self.rate_bps <= 0:
            raise ValueError(f"rate_bps must be > 0 or None, got {self.rate_bps}")
        if not 0 <= self.loss < 1:
            raise ValueError(f"loss must be in [0, 1), got {self.loss}")


@dataclass(frozen=True)
class RelayRoute:
    forward: DirectionSpec  # accepted peer -> target
    backward: DirectionSpec  # target -> accepted peer


@dataclass(frozen=True)
class ListenSpec:
    listen_host: str
    listen_port: int  # 0 = any free port
    target_host: str
    target_port: int
    routes: Mapping[str, RelayRoute]  # by the accepted peer's IP, so one address serves many sources; "*" = default
    buffer_bytes: int = 4 << 20  # bytes held per direction before reading stops (TCP back-pressure)

    def __post_init__(self) -> None:
        if "*" not in self.routes:
            raise ValueError("routes needs a default entry '*'")
        if self.buffer_bytes < 64 << 10:
            raise ValueError(f"buffer_bytes={self.buffer_bytes} is below 64 KiB")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ListenSpec":
        raw = json.loads(text)
        routes = {ip: RelayRoute(DirectionSpec(**r["forward"]), DirectionSpec(**r["backward"]))
                  for ip, r in raw.pop("routes").items()}
        return cls(routes=routes, **raw)


# ---------------------------------------------------------------- inside the relay process


class _Serializer:
    """The transmitter of one link: chunks leave one after another at the link rate."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free_at = 0.0

    def depart(self, now: float, nbytes: int, rate_bps: float) -> float:
        wire_bytes = nbytes * _WIRE_PER_PAYLOAD  # count headers as tbf does, so both modes give the same goodput
        with self._lock:
            self._free_at = max(now, self._free_at) + wire_bytes * 8 / rate_bps
            return self._free_at


class _Pipe:
    """One direction of one connection: read, stamp with a release time, hold, write in order."""

    def __init__(self, src: socket.socket, dst: socket.socket, spec: DirectionSpec, serializer: _Serializer | None,
                 buffer_bytes: int, on_done: Callable[[], None]) -> None:
        self.src, self.dst, self.spec, self.serializer = src, dst, spec, serializer
        self.buffer_bytes = buffer_bytes
        self.on_done = on_done
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()  # (release time, data); b"" = EOF
        self.queued_bytes = 0
        self.cond = threading.Condition()
        self.closed = False
        self.last_release = 0.0
        self.rng = random.Random()
        # small reads at low rates keep the serializer smooth; big reads at high rates keep the GIL cheap
        rate = spec.rate_bps
        self.read_bytes = 256 << 10 if rate is None else int(min(256 << 10, max(16 << 10, rate / 8 * 1e-3)))

    def start(self) -> None:
        for target in (self._reader, self._writer):
            threading.Thread(target=target, daemon=True).start()

    def _release_time(self, now: float, nbytes: int) -> float:
        spec = self.spec
        depart = now if spec.rate_bps is None or nbytes == 0 else self.serializer.depart(now, nbytes, spec.rate_bps)
        delay = spec.delay_s + (self.rng.uniform(-spec.jitter_s, spec.jitter_s) if spec.jitter_s else 0.0)
        if spec.loss and nbytes and self.rng.random() < 1 - (1 - spec.loss) ** math.ceil(nbytes / _MSS_BYTES):
            delay += spec.retransmit_s  # TCP would resend the lost segment and hold later bytes behind it
        self.last_release = max(self.last_release, depart + delay)  # jitter never reorders a byte stream
        return self.last_release

    def _reader(self) -> None:
        try:
            while True:
                with self.cond:
                    while self.queued_bytes >= self.buffer_bytes and not self.closed:
                        self.cond.wait()
                    if self.closed:
                        return
                data, ancillary, _, _ = self.src.recvmsg(self.read_bytes, _ANCILLARY_BYTES)
                arrived = _arrival_time(ancillary)
                with self.cond:
                    self.queue.append((self._release_time(arrived, len(data)), data))
                    self.queued_bytes += len(data)
                    self.cond.notify_all()
                if not data:
                    return
        except OSError:
            self.abort()

    def _writer(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.queue and not self.closed:
                        self.cond.wait()
                    if self.closed:
                        return
                    release, data = self.queue[0]
                _sleep_until(release)
                if not data:
                    self.dst.shutdown(socket.SHUT_WR)  # the FIN is delayed like any byte
                    break
                self.dst.sendall(data)
                with self.cond:
                    self.queue.popleft()
                    self.queued_bytes -= len(data)
                    self.cond.notify_all()
        except OSError:
            self.abort()
        finally:
            self.on_done()

    def abort(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        for sock in (self.src, self.dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _arrival_time(ancillary: list[tuple[int, int, bytes]]) -> float:
    """When the kernel received the bytes (SO_TIMESTAMPNS), on the monotonic clock.

    Timing from the kernel's stamp rather than from recv's return keeps the reader thread's wake-up
    latency (~30-50 us here) out of the emulated delay.
    """
    now = time.monotonic()
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == _SCM_TIMESTAMPNS and len(data) >= 16:
            sec, nsec = struct.unpack("qq", data[:16])
            return min(now, sec + nsec * 1e-9 - (time.time() - now))  # realtime stamp -> monotonic
    return now


def _sleep_until(deadline: float) -> None:
    # Sleeps here overshoot by ~35 us at 0.3 ms but ~200-450 us at 25 ms, so long waits are halved
    # repeatedly, short ones end early, and the last _SPIN_S is spun with GIL-releasing sleep(0) calls.
    while (remaining := deadline - time.monotonic()) > 0:
        if remaining > 1e-3:
            time.sleep(remaining / 2)
        elif remaining > 2 * _SPIN_S:
            time.sleep(remaining - _SPIN_S)
        else:
            time.sleep(0)


class _Relay:
    def __init__(self) -> None:
        self.serializers: dict[str, _Serializer] = collections.defaultdict(_Serializer)
        # reentrant: the SIGTERM handler (its parent died) runs `shutdown` in the main thread, which may be inside
        # `shutdown` already (the same death closes its control pipe): a plain Lock would deadlock it there for good
        self.lock = threading.RLock()
        self.listeners: list[socket.socket] = []
        self.conns: set[socket.socket] = set()

    def listen(self, spec: ListenSpec) -> int:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((spec.listen_host, spec.listen_port))
        sock.listen(512)
        with self.lock:
            self.listeners.append(sock)
        threading.Thread(target=self._accept_loop, args=(sock, spec), daemon=True).start()
        return sock.getsockname()[1]

    def _accept_loop(self, listener: socket.socket, spec: ListenSpec) -> None:
        while True:
            try:
                peer, (peer_ip, _) = listener.accept()
            except OSError:
                return  # listener closed at shutdown
            threading.Thread(target=self._connect, args=(peer, peer_ip, spec), daemon=True).start()

    def _connect(self, peer: socket.socket, peer_ip: str, spec: ListenSpec) -> None:
        route = spec.routes.get(peer_ip, spec.routes["*"])
        try:
            target = socket.create_connection((spec.target_host, spec.target_port), timeout=10)
        except OSError:
            peer.close()  # the peer sees the refusal as a closed connection
            return
        target.settimeout(None)
        for sock in (peer, target):
            sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the delay is ours; Nagle would add more
        with self.lock:
            self.conns.update((peer, target))
        remaining = [2]

        def done() -> None:
            with self.lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
                self.conns.difference_update((peer, target))
            peer.close()
            target.close()

        pipes = [self._pipe(peer, target, route.forward, spec, done),
                 self._pipe(target, peer, route.backward, spec, done)]
        for pipe in pipes:
            pipe.start()

    def _pipe(self, src: socket.socket, dst: socket.socket, d: DirectionSpec, spec: ListenSpec,
              done: Callable[[], None]) -> _Pipe:
        serializer = self.serializers[d.link_id] if d.rate_bps is not None else None
        return _Pipe(src, dst, d, serializer, spec.buffer_bytes, done)

    def shutdown(self) -> None:
        with self.lock:
            socks = self.listeners + list(self.conns)
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


def _tune_process() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)  # die with the parent, even on SIGKILL
    libc.prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)  # 1 us timer slack (default 50 us), inherited by threads
    sys.setswitchinterval(1e-4)  # hand the GIL over quickly: latency matters more than bulk efficiency here
    try:  # a real wire does not wait for CPU: when allowed, let the relay preempt the endpoints' compute
        os.setpriority(os.PRIO_PROCESS, 0, _NICE)
    except PermissionError:
        pass
    threading.stack_size(256 << 10)  # four threads per connection


def serve(control_in=sys.stdin, control_out=sys.stdout) -> None:
    """The relay process: one JSON request per line in, one JSON answer per line out; EOF stops it."""
    _tune_process()
    relay = _Relay()
    signal.signal(signal.SIGTERM, lambda *_: (relay.shutdown(), os._exit(0)))
    for line in control_in:
        try:
            request = json.loads(line)
            if request["op"] == "listen":
                answer = {"ok": True, "port": relay.listen(ListenSpec.from_json(request["spec"]))}
            elif request["op"] == "stop":
                break
            else:
                answer = {"ok": False, "error": f"unknown op {request['op']!r}"}
        except (OSError, ValueError, TypeError, KeyError) as exc:
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        control_out.write(json.dumps(answer) + "\n")
        control_out.flush()
    relay.shutdown()


# ---------------------------------------------------------------- in the parent


class RelayProcess:
    """A relay running in a child process; `listen` adds a forwarding address, `close` stops it."""

    def __init__(self, extra_env: Mapping[str, str] | None = None) -> None:
        env = dict(os.environ, **(extra_env or {}))
        # `-c`, not `-m`: the package imports this module first, and runpy warns about running it twice.
        # Its own session: a Ctrl-C reaches only the parent, which then closes the relay in order.
        # It dies with the thread that starts it (PR_SET_PDEATHSIG): start it from a long-lived thread.
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from swarmlm.bench.netem.delay_relay import serve; serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
        self._lock = threading.Lock()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def listen(self, spec: ListenSpec) -> tuple[str, int]:
        with self._lock:
            if self._proc.poll() is not None:
                raise RuntimeError(f"relay process exited with code {self._proc.returncode}")
            self._proc.stdin.write(json.dumps({"op": "listen", "spec": spec.to_json()}) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"relay process died (exit code {self._proc.wait()})")
        answer = json.loads(line)
        if not answer["ok"]:
            raise OSError(f"relay cannot listen on {spec.listen_host}:{spec.listen_port}: {answer['error']}")
        return spec.listen_host, int(answer["port"])

    def close(self, timeout_s: float = 5.0) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()  # EOF: the relay shuts its sockets and exits
            except OSError:
                pass
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        for stream in (self._proc.stdin, self._proc.stdout):
            try:
                stream.close()
            except OSError:
                pass

    def __enter__(self) -> "RelayProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    serve()
