"""`swarmlm dht [--host H] [--port P] [--identity FILE] [--addr-file PATH]`: a bootstrap node (and relay) for a
swarm."""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from swarmlm.cli.args import add_swarm_key


def add_parser(sub) -> None:
    p = sub.add_parser("dht", help="start a DHT bootstrap node and print its address")
    p.add_argument("--host", default="127.0.0.1",
                   help="the interface to listen on (0.0.0.0: every interface, for other machines)")
    p.add_argument("--port", type=int, default=0, help="the port to listen on (0: any free port)")
    p.add_argument("--initial-peers", nargs="*", default=[], metavar="ADDR",
                   help="other DHT nodes to join (none: this node starts a new swarm)")
    p.add_argument("--identity", metavar="FILE",
                   help="this node's P2P key (created if missing): with --port, it comes back at the same address "
                        "after a restart (peers and relayed servers that list it find it again)")
    p.add_argument("--addr-file", help="also write the address here (one per line)")
    p.add_argument("--no-relay", action="store_true",
                   help="answer dial-backs only: relay no server behind NAT (docs/PROTOCOL.md, Servers behind NAT)")
    add_swarm_key(p)
    p.add_argument("--new-swarm-key", metavar="FILE",
                   help="create a new private swarm's key in FILE (mode 0600) and start this node with it")


def run(args: argparse.Namespace) -> int:
    from swarmlm.swarm.dht import start_dht, visible_addrs

    swarm_key = args.swarm_key
    if args.new_swarm_key:
        from swarmlm.swarm.private import create_swarm_key

        try:
            swarm_key = create_swarm_key(args.new_swarm_key)
        except OSError as exc:
            raise SystemExit(f"swarmlm dht: cannot create {args.new_swarm_key}: {exc.strerror}") from None
    # with a swarm key this node stores and serves only records that carry its MAC (swarm/private.py)
    dht = start_dht(args.initial_peers, host=args.host, port=args.port, swarm_key=swarm_key,
                    identity_path=args.identity)
    from swarmlm.collector import freeze_start_up
    from swarmlm.swarm.relay import start_relay

    relay, _ = start_relay(dht, swarm_key, relaying=not args.no_relay)  # on the DHT's daemon: same address
    addrs = visible_addrs(dht)
    if args.addr_file:
        tmp = Path(args.addr_file + ".tmp")
        tmp.write_text("\n".join(addrs) + "\n")
        tmp.replace(args.addr_file)  # atomic: readers never see half an address
    freeze_start_up()  # a node runs for days: start-up's heap out of every collection (swarmlm/collector.py)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before the address is out: whoever reads it may stop us at once
        signal.signal(sig, lambda *_: stop.set())
    print("\n".join(addrs), flush=True)
    print(join_hint(addrs, args.host), file=sys.stderr, flush=True)
    stop.wait()
    relay.shutdown()
    dht.shutdown()
    return 0


def join_hint(addrs: list[str], host: str) -> str:
    """The line another machine needs: --initial-peers with this node's address other machines can dial."""
    outside = [a for a in addrs if not a.startswith(("/ip4/127.", "/ip6/::1/"))]
    if not outside:
        return (f"listening on {host} only: other machines cannot join (--host 0.0.0.0 lets them); on this machine "
                f"join with: --initial-peers {addrs[0] if addrs else '?'}")
    return f"other machines join with: --initial-peers {outside[0]}" + (
        f"  (or another of the addresses above, by the network they share)" if len(outside) > 1 else "")
