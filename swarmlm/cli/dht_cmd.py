"""`swarmlm dht [--host H] [--port P] [--addr-file PATH]`: a bootstrap node for a swarm."""
from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("dht", help="start a DHT bootstrap node and print its address")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--addr-file", help="also write the address here (one per line)")


def run(args: argparse.Namespace) -> int:
    from swarmlm.swarm.dht import start_dht, visible_addrs

    dht = start_dht(args.initial_peers, host=args.host, port=args.port)
    addrs = visible_addrs(dht)
    if args.addr_file:
        tmp = Path(args.addr_file + ".tmp")
        tmp.write_text("\n".join(addrs) + "\n")
        tmp.replace(args.addr_file)  # atomic: readers never see half an address
    print("\n".join(addrs), flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    dht.shutdown()
    return 0
