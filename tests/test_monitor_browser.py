"""The monitor page in a real browser: headless Chromium (Debian's package; `make chromium` installs it) loads `/`
from the real gateway against a live swarm; the rendered DOM shows every server and its blocks.

SWARMLM_DOCS_SCREENSHOT=1 also writes the screenshot to docs/img/monitor.png.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import httpx2 as httpx
import pytest

from swarmlm.api.process import GatewayProcess
from swarmlm.swarm.local import LocalSwarm
from tests.cdp import chromium
from tests.swarm_helpers import gateway_stack

pytestmark = pytest.mark.slow
DOCS_IMG = Path(__file__).resolve().parents[1] / "docs" / "img" / "monitor.png"


def run_chromium(args: list[str], profile: Path, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    """Headless, offline-safe flags; the whole process group is killed if it hangs."""
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1280,900",
           "--virtual-time-budget=8000", *args]  # virtual time: the page's fetches and 2 s timers run to completion
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its zygote and renderers
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


class _Cells(HTMLParser):
    """Rows of the servers table (by data-server) and the coverage cells that are on."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, list[str]] = {}
        self.on_cells: set[tuple[str, int]] = set()
        self._row: str | None = None
        self._in_td = False
        self.status = ""
        self._in_status = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "tr" and "data-server" in a:
            self._row = a["data-server"]
            self.rows[self._row] = []
        elif tag == "td" and self._row:
            self._in_td = True
            self.rows[self._row].append("")
        elif tag == "div" and "data-block" in a and a.get("class") == "cell-on":
            self.on_cells.add((a["data-server"], int(a["data-block"])))
        elif a.get("id") == "status":
            self._in_status = True

    def handle_endtag(self, tag):
        if tag == "tr":
            self._row = None
        elif tag == "td":
            self._in_td = False
        elif tag == "div":
            self._in_status = False

    def handle_data(self, data):
        if self._in_td and self._row:
            self.rows[self._row][-1] += data
        if self._in_status:
            self.status += data


@pytest.fixture(scope="module")
def stack(tiny_bloom, tmp_path_factory):
    """A DHT, 2 servers and the gateway (tests/swarm_helpers.py), one for the module."""
    with gateway_stack(tiny_bloom, tmp_path_factory.mktemp("api")) as stack:
        yield stack


@pytest.fixture(scope="module")
def swarm(stack) -> LocalSwarm:
    return stack[0]


@pytest.fixture(scope="module")
def gateway(stack) -> GatewayProcess:
    return stack[1]


def test_monitor_page_shows_every_server_and_its_blocks(gateway, swarm, tiny_bloom, tmp_path):
    for prompt in ("The quick brown fox", "Water boils at"):  # some traffic for the charts and cards
        r = httpx.post(f"{gateway.url}/v1/completions", timeout=120,
                       json={"model": tiny_bloom, "prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
    dom = run_chromium(["--dump-dom", f"{gateway.url}/"], tmp_path / "profile-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    page = _Cells()
    page.feed(dom.stdout)
    ids = {s.server_id for s in swarm.servers}
    assert set(page.rows) == ids, dom.stdout[-3000:]
    by_id = {s.server_id: s for s in swarm.servers}
    for sid, cells in page.rows.items():
        start, end = by_id[sid].ready["blocks"]
        assert by_id[sid].address in cells and f"[{start}, {end})" in cells and "online" in cells, cells
        assert {b for s, b in page.on_cells if s == sid} == set(range(start, end))
    assert "fully covered" in page.status

    shot = tmp_path / "monitor.png"
    result = run_chromium([f"--screenshot={shot}", f"{gateway.url}/"], tmp_path / "profile-shot")
    assert result.returncode == 0 and shot.stat().st_size > 10_000, result.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("SWARMLM_DOCS_SCREENSHOT") == "1":
        DOCS_IMG.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, DOCS_IMG)
