"""A full framed port refusing newcomers whose request crosses the refusal: how many read the STATUS.

A tiny-bloom server in this process with --max-concurrent-rpcs 2 and two live streams; then N newcomers, one after
another, each sending HELLO + an open request `--delay-ms` after connecting, half-closing, and reading. The server
refuses before reading (RESOURCE_EXHAUSTED); a plain close with the request unread resets the connection, and the
newcomer's shutdown or read fails (docs/PROTOCOL.md "Framed steps": the gentle close).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/refusal_race.py [--newcomers 200] [--delay-ms 0 2]

Prints, per delay, how each newcomer ended: "STATUS" (the refusal read) or the OSError it got.
"""
from __future__ import annotations

import argparse
import socket
import tempfile
import time
from collections import Counter

import torch

from swarmlm.bench.frame_attacks import HELLO, frame_port, open_request
from swarmlm.machine import machine_line
from swarmlm.model.random_checkpoint import init_checkpoint
from swarmlm.types import BlockRange
from tests.swarm_helpers import in_process_server, poll_until


def newcomer(host: str, port: int, delay_s: float) -> str:
    with socket.create_connection((host, port), timeout=30.0) as sock:
        time.sleep(delay_s)
        try:
            sock.sendall(HELLO + open_request(2))
            sock.shutdown(socket.SHUT_WR)
            got = sock.recv(1 << 16)
        except OSError as exc:
            return f"{type(exc).__name__} errno {exc.errno}"
    return "STATUS" if b"RESOURCE_EXHAUSTED" in got else f"other {got[:20]!r}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--newcomers", type=int, default=200)
    parser.add_argument("--delay-ms", type=float, nargs="+", default=[0.0, 2.0])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(machine_line())
    model = str(init_checkpoint("tiny-bloom", tempfile.mkdtemp(), seed=1, max_shard_size="100KB"))
    with in_process_server(model, BlockRange(0, 2), max_concurrent_rpcs=2) as server:
        host, port = "127.0.0.1", frame_port(server.address)
        live = [socket.create_connection((host, port)) for _ in range(2)]
        for sock in live:
            sock.sendall(HELLO + open_request(2))
        assert poll_until(lambda: len(server._frames.connections) == 2 and not server._frames.idle, 30.0)
        for delay_ms in args.delay_ms:
            ends = Counter(newcomer(host, port, delay_ms / 1000) for _ in range(args.newcomers))
            print(f"delay {delay_ms} ms: {dict(ends)}")
        for sock in live:
            sock.close()


if __name__ == "__main__":
    main()
