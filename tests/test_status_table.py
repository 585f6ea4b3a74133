"""`swarmlm status`'s table: piped, no cell is cut (rich alone assumes 80 columns when the output is not a terminal);
on a terminal, the terminal's own width (a pseudo-terminal of 100 columns here)."""
from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import struct
import subprocess
import sys
import termios

from swarmlm.cli.status_cmd import render, table_console

NUM_BLOCKS = 30


def _view() -> dict:
    """A swarm view as SwarmWatcher.read() returns it: 3 servers with long addresses over 30 blocks, one hole."""
    servers = []
    for i, (start, end) in enumerate([(0, 10), (10, 20), (10, 20)]):
        servers.append({"id": f"12D3KooWServerIdentity{i:04d}xyz", "blocks": [start, end], "state": "online",
                        "address": f"server-{i}.rack-7.example.internal:4{i}000", "active_sessions": i,
                        "queue_length": 0, "cache_bytes_free": 3 << 28, "tokens_per_s": 41.5, "rtt_s": 0.0123,
                        "quant": "none", "dtype": "float32", "kv_dtype": ("float16", "float32", "")[i]})
    coverage = [1] * 10 + [2] * 10 + [0] * 10
    return {"num_blocks": NUM_BLOCKS, "servers": servers, "coverage": coverage,
            "missing_blocks": list(range(20, 30)), "complete": False}


def test_piped_table_cuts_nothing():
    out = io.StringIO()
    assert render(_view(), "/models/a-long-checkpoint-directory-name/SmolLM2-135M-Instruct", table_console(out)) == 1
    lines = out.getvalue().splitlines()
    for s in _view()["servers"]:
        start, end = s["blocks"]
        bar = "." * start + "#" * (end - start) + "." * (NUM_BLOCKS - end)
        row = [line for line in lines if s["address"] in line]  # the whole row on one line
        assert len(row) == 1 and s["id"][-8:] in row[0] and f"[{start}, {end})" in row[0] and bar in row[0], lines
        assert (s["kv_dtype"] or "-") in row[0].split()  # the KV column ("-": a server before the field)
    assert max(len(line) for line in lines) > 80
    assert "SmolLM2-135M-Instruct: 3 servers, 30 blocks" in out.getvalue()  # a name, not the path
    assert "a-long-checkpoint-directory-name" not in out.getvalue()
    assert "live servers per block: [0, 10) 1, [10, 20) 2, [20, 30) 0" in out.getvalue()
    assert "blocks with no live server: [20, 30)" in out.getvalue()


def test_terminal_table_takes_the_terminal_width():
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))  # rows, columns
    code = ("import json, sys\nfrom swarmlm.cli.status_cmd import render, table_console\n"
            "console = table_console()\nprint('width', console.is_terminal, console.width)\n"
            f"render(json.loads({json.dumps(json.dumps(_view()))}), 'model', console)\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("COLUMNS", "LINES", "FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")}
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=follower,
                            stderr=subprocess.PIPE, env={**env, "TERM": "xterm"})
    os.close(follower)
    output = b""
    try:
        while chunk := os.read(leader, 1 << 16):
            output += chunk
    except OSError:  # EIO: the child closed the terminal
        pass
    finally:
        os.close(leader)
    assert proc.wait(60) == 0, proc.stderr.read().decode()
    proc.stderr.close()
    text = output.decode().replace("\r\n", "\n")
    assert "width True 100" in text, text
    plain = [line for line in text.splitlines() if not line.startswith("width")]
    width = max(len(_strip_ansi(line)) for line in plain)
    assert 80 < width <= 100, text  # wider than rich's default of 80, within the terminal


def _strip_ansi(line: str) -> str:
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", line)


def _tokens(text: str) -> list[str]:
    import re

    return [t for t in re.split(r"[\s│┃┏┓┗┛┡┩└┘┳┻╇┴━─┬┼╋]+", text) if t]


def test_at_80_columns_every_line_fits_and_no_word_is_cut(monkeypatch):
    """$COLUMNS=80 (or an 80-column terminal): columns are dropped, least important first, the coverage bar is
    scaled, and every word shown is a whole word of the full table."""
    view = _view()
    view["servers"][1]["state"] = "offline"
    view["servers"][2].update(address="p2p/12D3KooWRelayedServerPeerIdentity", relayed=True)
    wide = io.StringIO()
    render(view, "smollm2-135m-instruct", table_console(wide))
    whole_words = set(_tokens(wide.getvalue()))
    for columns in (80, 60, 40):
        monkeypatch.setenv("COLUMNS", str(columns))
        out = io.StringIO()
        render(view, "smollm2-135m-instruct", table_console(out))
        lines = out.getvalue().splitlines()
        assert max(len(line) for line in lines) <= columns, out.getvalue()
        bars = {t for t in _tokens(out.getvalue()) if set(t) <= {"#", "."}}  # scaled to the room: not a cut
        assert set(_tokens(out.getvalue())) - bars <= whole_words, out.getvalue()
        assert all(len(bar) <= NUM_BLOCKS for bar in bars)
        table = out.getvalue()
        assert all(s["id"][-8:] in table for s in view["servers"]) and "offline" in table and "[10, 20)" in table
