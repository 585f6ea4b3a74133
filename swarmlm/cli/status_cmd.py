"""`swarmlm status --initial-peers ADDR [--model M] [--json]`: the swarm as a client sees it, as a table (the same
view as the gateway's /v1/swarm)."""
from __future__ import annotations

import argparse
import json

from swarmlm.cli.args import add_swarm_key


def add_parser(sub) -> None:
    p = sub.add_parser("status", help="show the swarm's servers, their blocks, load and coverage")
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--servers", nargs="*", default=[], help="direct host:port list instead of a DHT")
    p.add_argument("--model", required=True,
                   help="checkpoint directory or model id: it names the model's records in the DHT")
    p.add_argument("--json", action="store_true", help="print the view as JSON (as GET /v1/swarm)")
    add_swarm_key(p)


PIPED_WIDTH = 1 << 14  # columns when the output is not a terminal: a row per line, no cell cut or wrapped


def run(args: argparse.Namespace) -> int:
    from swarmlm.api.swarm_view import SwarmWatcher
    from swarmlm.client.model import DistributedModelForCausalLM

    model = DistributedModelForCausalLM.from_pretrained(args.model, initial_peers=args.initial_peers,
                                                        servers=args.servers, swarm_key=args.swarm_key)
    try:
        view = SwarmWatcher(model.remote).read()
    finally:
        model.close()
    if args.json:
        print(json.dumps(view))
        return 0 if view["complete"] else 1
    return render(view, args.model, table_console())


def table_console(file=None):
    """A terminal's own width; piped or redirected (rich would assume 80 columns), wide enough for any table."""
    from rich.console import Console

    console = Console(file=file)
    return console if console.is_terminal else Console(file=file, width=PIPED_WIDTH)


def render(view: dict, model: str, console) -> int:
    """The swarm view (SwarmWatcher.read) as a table and a coverage line; 0 if every block is served, else 1."""
    from rich.table import Table

    table = Table(title=f"{model}: {len(view['servers'])} servers, {view['num_blocks']} blocks")
    for col in ("server", "address", "blocks", "state", "sessions", "queue", "cache free MiB", "tokens/s", "RTT ms",
                "coverage"):
        table.add_column(col, justify="right" if col in ("sessions", "queue", "cache free MiB", "tokens/s", "RTT ms")
                         else "left", overflow="fold")  # a terminal narrower than the table: wrapped, never cut
    n = view["num_blocks"]
    for s in view["servers"]:
        start, end = s["blocks"]
        bar = "." * start + "#" * (end - start) + "." * (n - end)
        state = s["state"] if s["state"] == "online" else f"[red]{s['state']}[/red]"
        table.add_row(
            s["id"][-12:], s["address"] + (" (relayed)" if s.get("relayed") else ""), f"[{start}, {end})", state, str(s["active_sessions"]), str(s["queue_length"]),
            f"{s['cache_bytes_free'] / 2**20:.1f}", f"{s['tokens_per_s']:.1f}" if s["tokens_per_s"] else "-",
            f"{s['rtt_s'] * 1000:.1f}" if s["rtt_s"] is not None else "-", bar,
        )
    console.print(table)
    coverage = " ".join(str(c) for c in view["coverage"])
    console.print(f"live servers per block: {coverage}")
    if view["missing_blocks"]:
        console.print(f"[red]blocks with no live server: {view['missing_blocks']}[/red]")
        return 1
    console.print("[green]every block is served[/green]")
    return 0
