"""The floor under one swarmlm hop: a raw grpc.aio bidi-stream round trip (4 KB each way, server in another process,
the client calling from another thread, as swarmlm's client does), and what a long burst of compute before each
message does to it (as a 24-block forward on the server and a 250k-row LM head on the client do).

    .venv/bin/python benchmarks/grpc_floor.py [--round-trips 50] [--rounds 2]

Per round, side by side: no compute; a 1 GB memory sweep per side (torch sum, ~0.1-0.2 s here); 120 ms of
in-cache compute per side (a 64x64 matmul loop); a 64 MB sweep; no compute, both sides asleep for 120 ms
(what a server waiting for its turn in a chain, or a client waiting for the chain, does); and, for comparison, a
plain TCP socket echo (no gRPC, no asyncio) without and with the 120 ms of sleep. The server computes in a
worker thread (as swarmlm's scheduler) before it replies and reports how long; the client computes before it
writes. Reported: the median round trip minus the server's compute, i.e. what the gRPC + Python stack costs
around the compute.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

# MB swept; -1: in-cache compute, -2: no compute at all, both sides idle (asleep) 120 ms
BURSTS = {"none": 0, "1 GB sweep": 1024, "120 ms in-cache compute": -1, "64 MB sweep": 64, "120 ms idle (sleep)": -2}
IDLE_S = 0.12
MESSAGE = b"x" * 4096


def _burst(mb: int):
    """A function that computes like `mb` (see BURSTS), with its buffers allocated once."""
    import torch

    torch.set_num_threads(1)
    big = torch.ones(mb * 262144) if mb > 0 else None  # mb MB of float32
    small = torch.ones(64, 64)

    def run() -> None:
        if big is not None:
            big.sum()
        elif mb == -2:
            time.sleep(IDLE_S)
        elif mb < 0:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 0.12:
                small @ small
    return run


def _serve(port_queue, mb: int) -> None:
    burst = _burst(mb)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        worker = ThreadPoolExecutor(1)

        def work() -> float:
            t0 = time.perf_counter()
            burst()
            return time.perf_counter() - t0

        async def echo(requests, context):
            async for msg in requests:
                compute_s = await loop.run_in_executor(worker, work)
                yield struct.pack("d", compute_s) + msg[8:]

        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "floor.Floor", {"Echo": grpc.stream_stream_rpc_method_handler(echo)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_queue.put(port)
        await server.wait_for_termination()

    asyncio.run(main())


def round_trip_ms(mb: int, round_trips: int) -> float:
    """Median round trip minus the server's compute, in ms."""
    ctx = mp.get_context("spawn")  # (a forked child would inherit this process's gRPC state)
    port_queue = ctx.Queue()
    server = ctx.Process(target=_serve, args=(port_queue, mb), daemon=True)
    server.start()
    try:
        port = port_queue.get(timeout=60)
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        burst = _burst(mb)

        async def open_call():
            return grpc.aio.insecure_channel(f"127.0.0.1:{port}").stream_stream("/floor.Floor/Echo")()

        call = asyncio.run_coroutine_threadsafe(open_call(), loop).result()

        async def one() -> bytes:
            await call.write(MESSAGE)
            return await call.read()

        times = []
        for _ in range(round_trips + 5):  # the first 5 warm up
            burst()
            t0 = time.perf_counter()
            reply = asyncio.run_coroutine_threadsafe(one(), loop).result()
            times.append(time.perf_counter() - t0 - struct.unpack("d", reply[:8])[0])
        loop.call_soon_threadsafe(loop.stop)
        return statistics.median(times[5:]) * 1e3
    finally:
        server.terminate()
        server.join(5)


def _tcp_echo(port_queue) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port_queue.put(listener.getsockname()[1])
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := conn.recv(65536):
        conn.sendall(data)


def tcp_round_trip_ms(idle_s: float, round_trips: int) -> float:
    """The same 4 KB round trip over a plain TCP socket (no gRPC, no asyncio), after `idle_s` of sleep: how much
    of the cost after idling is the kernel's and how much the stack's above it."""
    ctx = mp.get_context("spawn")
    port_queue = ctx.Queue()
    server = ctx.Process(target=_tcp_echo, args=(port_queue,), daemon=True)
    server.start()
    try:
        with socket.create_connection(("127.0.0.1", port_queue.get(timeout=60))) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            times = []
            for _ in range(round_trips + 5):
                time.sleep(idle_s)
                t0 = time.perf_counter()
                conn.sendall(MESSAGE)
                got = 0
                while got < len(MESSAGE):
                    got += len(conn.recv(65536))
                times.append(time.perf_counter() - t0)
        return statistics.median(times[5:]) * 1e3
    finally:
        server.terminate()
        server.join(5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--round-trips", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    results: dict[str, list[float]] = {name: [] for name in BURSTS}
    for _ in range(args.rounds):
        for name, mb in BURSTS.items():
            results[name].append(round_trip_ms(mb, args.round_trips))
    print(f"load average {os.getloadavg()[0]:.2f}; median of {args.round_trips} round trips per round, rounds: "
          f"{args.rounds}")
    print("| compute before each message, per side | round trip minus the server's compute, ms (per round) |")
    print("|---|---|")
    for name, values in results.items():
        print(f"| {name} | {' / '.join(f'{v:.2f}' for v in values)} |")
    for name, idle_s in (("plain TCP socket, none", 0.0), ("plain TCP socket, 120 ms idle (sleep)", IDLE_S)):
        values = [tcp_round_trip_ms(idle_s, args.round_trips) for _ in range(args.rounds)]
        print(f"| {name} | {' / '.join(f'{v:.2f}' for v in values)} |")


if __name__ == "__main__":
    main()
