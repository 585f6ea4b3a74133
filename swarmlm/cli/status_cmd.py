"""`swarmlm status --initial-peers ADDR [--model M] [--json]`: the swarm as a client sees it, as a table (the same
view as the gateway's /v1/swarm)."""
from __future__ import annotations

import argparse
import json

from swarmlm.cli.args import add_swarm_key


def add_parser(sub) -> None:
    p = sub.add_parser("status", help="show the swarm's servers, their blocks, load and coverage")
    p.add_argument("--initial-peers", nargs="*", default=[], metavar="ADDR",
                   help="DHT multiaddrs (printed by `swarmlm dht`)")
    p.add_argument("--servers", nargs="*", default=[], help="direct host:port list instead of a DHT")
    p.add_argument("--model", required=True,
                   help="checkpoint directory or model id: it names the model's records in the DHT")
    p.add_argument("--json", action="store_true", help="print the view as JSON (as GET /v1/swarm)")
    add_swarm_key(p)


PIPED_WIDTH = 1 << 14  # columns when the output is not a terminal: a row per line, no cell cut or wrapped
MIN_BAR = 10  # characters of the coverage bar at least (a longer model's bar is scaled down to the room left)

# the table's columns, most important first (a narrow terminal drops from the end): header, right-aligned, cell
COLUMNS = [
    ("server", False, lambda s: s["id"][-8:]),
    ("blocks", False, lambda s: f"[{s['blocks'][0]}, {s['blocks'][1]})"),
    ("state", False, lambda s: s["state"]),
    ("address", False, lambda s: s["address"] + (" (relayed)" if s.get("relayed") else "")),
    ("tok/s", True, lambda s: f"{s['tokens_per_s']:.1f}" if s["tokens_per_s"] else "-"),
    ("sessions", True, lambda s: str(s["active_sessions"])),
    ("coverage", False, None),  # the bar: as wide as the room left allows, MIN_BAR at least
    ("RTT ms", True, lambda s: f"{s['rtt_s'] * 1000:.1f}" if s["rtt_s"] is not None else "-"),
    ("queue", True, lambda s: str(s["queue_length"])),
    ("cache MiB", True, lambda s: f"{s['cache_bytes_free'] / 2**20:.0f}"),
    ("quant", False, lambda s: s["quant"]),  # int8 / int4 weights compute other values than the checkpoint's
    ("KV", False, lambda s: s["kv_dtype"] or "-"),  # its caches' dtype ("-": a server before the field)
]


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
    """A terminal's own width (or $COLUMNS when set); piped or redirected (rich would assume 80 columns), wide enough
    for any table."""
    import os

    from rich.console import Console

    console = Console(file=file)
    return console if console.is_terminal or os.environ.get("COLUMNS", "").isdigit() else \
        Console(file=file, width=PIPED_WIDTH)


def coverage_bar(blocks: tuple[int, int], num_blocks: int, width: int) -> str:
    """`..###...`: one character per block, or per group of blocks when the bar has fewer characters than blocks
    ('#' where the server holds any block of the group)."""
    width = max(1, min(width, num_blocks))
    start, end = blocks
    return "".join("#" if start * width < (i + 1) * num_blocks and end * width > i * num_blocks else "."
                   for i in range(width))


def runs(values: list[int]) -> list[tuple[str, int]]:
    """[1, 1, 2, 0, 0] -> [("[0, 2)", 1), ("[2, 3)", 2), ("[3, 5)", 0)]: equal neighbours as half-open ranges."""
    out, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            out.append((f"[{start}, {i})", values[start]))
            start = i
    return out


def fitted_columns(rows: list[list[str]], num_blocks: int, width: int) -> tuple[list[int], int]:
    """Which COLUMNS fit `width` characters, most important first, and the coverage bar's length (0: dropped). A
    column takes its widest cell plus 3 characters (padding and border), so no cell is ever wrapped or cut."""
    def need(i: int) -> int:
        return max([len(COLUMNS[i][0])] + [len(r[i]) for r in rows]) + 3

    used, keep, bar_at = 1, [], None
    for i, (header, _, _) in enumerate(COLUMNS):
        cost = max(len(header), min(MIN_BAR, num_blocks)) + 3 if COLUMNS[i][2] is None else need(i)
        if used + cost <= width:
            used += cost
            keep.append(i)
            bar_at = i if COLUMNS[i][2] is None else bar_at
    bar = 0 if bar_at is None else min(num_blocks, width - used + max(len("coverage"), min(MIN_BAR, num_blocks)))
    return sorted(keep), bar


def render(view: dict, model: str, console) -> int:
    """The swarm view (SwarmWatcher.read) as a table fitted to the console's width and a coverage line; 0 if every
    block is served, else 1."""
    from rich.markup import escape
    from rich.table import Table

    from swarmlm.model.source import served_name

    n = view["num_blocks"]
    rows = [[cell(s) if cell else "" for _, _, cell in COLUMNS] for s in view["servers"]]
    keep, bar = fitted_columns(rows, n, console.width)
    table = Table(title=f"{served_name(model)}: {len(view['servers'])} servers, {n} blocks")
    for i in keep:
        table.add_column(COLUMNS[i][0], justify="right" if COLUMNS[i][1] else "left", no_wrap=True)
    for s, row in zip(view["servers"], rows):
        cells = {i: coverage_bar(s["blocks"], n, bar) if COLUMNS[i][2] is None else row[i] for i in keep}
        if "state" in (COLUMNS[i][0] for i in keep) and s["state"] != "online":
            cells[2] = f"[red]{s['state']}[/red]"
        table.add_row(*(cells[i] for i in keep))
    console.print(table)
    for s in view["servers"]:  # why a server announced there is not used (another wire protocol, other weights...)
        if s.get("refused"):
            console.print(f"[red]server {escape(s['id'][-8:])} is refused: {escape(s['refused'])}[/red]")
    console.print("live servers per block: " + ", ".join(f"{r} {c}" for r, c in runs(view["coverage"])))
    if view["missing_blocks"]:
        missing = [r for r, c in runs(view["coverage"]) if c == 0]
        console.print(f"[red]blocks with no live server: {', '.join(missing)}[/red]")
        return 1
    console.print("[green]every block is served[/green]")
    return 0
