"""Measure what a link really does: RTT by small echo round trips, bandwidth by a bulk transfer.

The probe server is a tiny TCP service (`python -m swarmlm.bench.netem.link_probe --host H --port P`), started
where a swarm server would run (inside a host's namespace), and measured through `Testbed.expose`.
Protocol: one mode byte, then
  b"E": echo; the client sends _ECHO_BYTES-byte messages and reads each back.
  b"U" + u64 n: the client sends n bytes; the server answers (bytes after the first recv, seconds between
        the first and the last recv) as u64 + f64, so the rate is measured where the bytes arrive.
  b"D" + u64 n: the server sends n bytes; the client times them the same way.
"""
from __future__ import annotations

import argparse
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Sequence

_ECHO_BYTES = 64
_CHUNK_BYTES = 256 << 10
_RESULT = struct.Struct("!Qd")


@dataclass(frozen=True)
class RttStats:
    median_s: float
    p10_s: float
    p25_s: float
    p90_s: float
    samples: int


@dataclass(frozen=True)
class BandwidthStats:
    bytes_per_s: float
    nbytes: int  # bytes timed (the first chunk only starts the clock)
    elapsed_s: float
    direction: str  # "up": towards the probe server, "down": from it

    @property
    def bits_per_s(self) -> float:
        return self.bytes_per_s * 8


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def _connect(address: str, timeout_s: float) -> socket.socket:
    sock = socket.create_connection(_split(address), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _timed_drain(sock: socket.socket, n: int) -> tuple[int, float]:
    """Read n bytes; return (bytes after the first recv, seconds from the first to the last recv)."""
    first = sock.recv(_CHUNK_BYTES)
    if not first:
        raise ConnectionError("connection closed before any data")
    start = time.monotonic()
    got = len(first)
    while got < n:
        chunk = sock.recv(min(_CHUNK_BYTES, n - got))
        if not chunk:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += len(chunk)
    return n - len(first), time.monotonic() - start


def measure_rtt(address: str, samples: int = 50, warmup: int = 3, timeout_s: float = 10.0) -> RttStats:
    """Median of `samples` small round trips over one connection (after `warmup` untimed ones)."""
    with _connect(address, timeout_s) as sock:
        sock.sendall(b"E")
        message = b"x" * _ECHO_BYTES
        times = []
        for i in range(warmup + samples):
            start = time.monotonic()
            sock.sendall(message)
            _recv_exact(sock, _ECHO_BYTES)
            if i >= warmup:
                times.append(time.monotonic() - start)
    times.sort()
    n = len(times)
    return RttStats(statistics.median(times), times[n // 10], times[n // 4], times[(n * 9) // 10], n)


def measure_bandwidth(address: str, nbytes: int, direction: str = "up", timeout_s: float = 60.0) -> BandwidthStats:
    """Bulk-transfer `nbytes` and time it at the receiving end (setup and the first chunk excluded)."""
    if direction not in ("up", "down"):
        raise ValueError(f"direction must be 'up' or 'down', got {direction!r}")
    if nbytes < 4 * _CHUNK_BYTES:
        raise ValueError(f"nbytes={nbytes} is too small to time; use at least {4 * _CHUNK_BYTES}")
    with _connect(address, timeout_s) as sock:
        sock.sendall((b"U" if direction == "up" else b"D") + struct.pack("!Q", nbytes))
        if direction == "up":
            payload = memoryview(b"\0" * _CHUNK_BYTES)
            sent = 0
            while sent < nbytes:
                sent += sock.send(payload[: nbytes - sent])
            timed, elapsed = _RESULT.unpack(_recv_exact(sock, _RESULT.size))
        else:
            timed, elapsed = _timed_drain(sock, nbytes)
    return BandwidthStats(timed / elapsed, int(timed), elapsed, direction)


# ---------------------------------------------------------------- the probe server


def _handle(sock: socket.socket) -> None:
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mode = sock.recv(1)
        if mode == b"E":
            while message := sock.recv(_ECHO_BYTES):
                sock.sendall(message)
        elif mode in (b"U", b"D"):
            (n,) = struct.unpack("!Q", _recv_exact(sock, 8))
            if mode == b"U":
                sock.sendall(_RESULT.pack(*_timed_drain(sock, n)))
            else:
                payload = memoryview(b"\0" * _CHUNK_BYTES)
                sent = 0
                while sent < n:
                    sent += sock.send(payload[: n - sent])
                sock.shutdown(socket.SHUT_WR)
                sock.recv(1)  # wait for the client to close, so no byte is lost to an early reset


def serve(host: str, port: int, ready: threading.Event | None = None) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(64)
    print(f"probe listening on {host}:{listener.getsockname()[1]}", flush=True)
    if ready is not None:
        ready.set()
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_handle_safely, args=(conn,), daemon=True).start()


def _handle_safely(sock: socket.socket) -> None:
    try:
        _handle(sock)
    except OSError:
        pass  # a client that went away mid-measurement is not the server's problem


def probe_server_argv(host: str, port: int = 0) -> list[str]:
    """Command line of a probe server (port 0: any free port, printed on its first line of output)."""
    return [sys.executable, "-c", "from swarmlm.bench.netem.link_probe import main; main()", "--host", host,
            "--port", str(port)]


def start_probe_server(host: str, port: int = 0, prefix: Sequence[str] = ()) -> tuple[subprocess.Popen, int]:
    """Start a probe server (inside a namespace with prefix = Testbed.exec_prefix(i)); returns it and its port."""
    proc = subprocess.Popen(list(prefix) + probe_server_argv(host, port), stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("probe listening"):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"probe server did not start on {host}:{port} (output {line!r})")
    return proc, int(line.rsplit(":", 1)[1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="netem probe server (echo / bulk sink / bulk source)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    serve(args.host, args.port)


if __name__ == "__main__":
    main()
