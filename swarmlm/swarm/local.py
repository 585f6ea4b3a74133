"""A swarm on this machine: a DHT bootstrap node and N server processes, started and always stopped together.

Used by `swarmlm demo`, the tests and the benchmarks. Every process it starts is stopped on exit, on an error,
and at interpreter exit (atexit), and gets SIGTERM from the kernel when its owner's process dies otherwise (a
SIGTERM, a SIGKILL: swarm/lifetime.py `popen_dying_with_us`), so nothing outlives its owner.
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from swarmlm.swarm.lifetime import popen_dying_with_us
from swarmlm.types import BlockRange


def even_split(num_blocks: int, servers: int) -> list[BlockRange]:
    """Contiguous ranges as in the scaling study: q, r = divmod(L, N); the first r servers get q + 1 blocks."""
    if not 1 <= servers <= num_blocks:
        raise ValueError(f"cannot split {num_blocks} blocks over {servers} servers")
    q, r = divmod(num_blocks, servers)
    ranges, start = [], 0
    for i in range(servers):
        end = start + q + (1 if i < r else 0)
        ranges.append(BlockRange(start, end))
        start = end
    return ranges


def read_ready_line(stdout, timeout_s: float) -> dict:
    """The first JSON line with event=ready a child prints (servers, the API gateway), or {} after timeout_s."""
    return read_event(stdout, "ready", timeout_s)


def read_event(stdout, event: str, timeout_s: float) -> dict:
    """The next JSON line with this event a child prints on stdout (a server's "ready", "moved", ...), or {} after
    timeout_s."""
    result: dict = {}

    def read() -> None:
        for line in stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict) and msg.get("event") == event:
                result.update(msg)
                return

    reader = threading.Thread(target=read, daemon=True)  # a thread: stdout has no read timeout
    reader.start()
    reader.join(timeout_s)
    return result


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    args: list[str]
    ready: dict = field(default_factory=dict)  # the server's "ready" JSON line
    log_path: Path | None = None

    @property
    def address(self) -> str:
        return self.ready.get("address", "")

    @property
    def server_id(self) -> str:
        return self.ready.get("server_id", "")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


_LIVE: set[subprocess.Popen] = set()


def _kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal the process and everything it started (its p2pd daemons): each runs in its own session."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_all() -> None:
    for p in list(_LIVE):
        _kill_group(p)


atexit.register(_kill_all)


class LocalSwarm:
    def __init__(self, model_dir: str | Path, threads: int = 1, log_dir: str | Path | None = None,
                 server_args: Sequence[str] = (), start_timeout_s: float = 180.0, with_dht: bool = True,
                 swarm_key_file: str | Path | None = None) -> None:
        self.model_dir = str(model_dir)
        self.threads = threads
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="swarmlm-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # a private swarm: the DHT node and every server get the key (swarm/private.py)
        self.key_args = ["--swarm-key", str(swarm_key_file)] if swarm_key_file else []
        self.server_args = [*self.key_args, *server_args]
        self.start_timeout_s = start_timeout_s
        self.with_dht = with_dht
        self.dht_proc: subprocess.Popen | None = None
        self.dht_nodes: list[subprocess.Popen] = []  # every `swarmlm dht` started (dht_proc is the first)
        self.initial_peers: list[str] = []
        self.servers: list[ServerProcess] = []

    # ---- processes -----------------------------------------------------------------------------------------
    def _spawn(self, args: list[str], name: str, prefix: Sequence[str] = ()) -> tuple[subprocess.Popen, Path]:
        log = self.log_dir / f"{name}.err"
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(self.threads))
        with open(log, "w") as err:
            proc = popen_dying_with_us(  # (SIGTERM when this process dies, whatever kills it: swarm/lifetime.py)
                [*prefix, sys.executable, "-m", "swarmlm.cli.main", *args],
                stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, text=True, env=env,
                start_new_session=True,  # Ctrl-C in a terminal reaches us, not them: we stop them in order
            )
        _LIVE.add(proc)
        return proc, log

    def start_dht(self, host: str = "127.0.0.1") -> None:
        self.dht_proc, self.initial_peers = self.spawn_dht("dht", host)

    def spawn_dht(self, name: str, host: str = "127.0.0.1",
                  extra: Sequence[str] = ()) -> tuple[subprocess.Popen, list[str]]:
        """A `swarmlm dht` node (bootstrap and relay; another one with `extra` = ["--initial-peers", ...]):
        its process and addresses; stopped with the swarm."""
        addr_file = self.log_dir / f"{name}.addr"
        addr_file.unlink(missing_ok=True)
        proc, log = self._spawn(["dht", "--host", host, "--addr-file", str(addr_file), *self.key_args, *extra], name)
        deadline = time.monotonic() + self.start_timeout_s
        while not addr_file.is_file():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"DHT did not start; see {log}:\n{log.read_text()[-2000:]}")
            time.sleep(0.1)
        self.dht_nodes.append(proc)
        return proc, [line for line in addr_file.read_text().split() if line]

    def start_server(self, blocks: BlockRange | None, extra: Sequence[str] = (), wait: bool = True,
                     prefix: Sequence[str] = (), host: str = "127.0.0.1") -> ServerProcess:
        args = ["server", "--model", self.model_dir, "--threads", str(self.threads), "--host", host,
                *self.server_args, *extra]
        if blocks is not None:
            args += ["--blocks", f"{blocks.start}:{blocks.end}"]
        if self.initial_peers:
            args += ["--initial-peers", *self.initial_peers]
        proc, log = self._spawn(args, f"server{len(self.servers)}", prefix)
        server = ServerProcess(proc, args, log_path=log)
        self.servers.append(server)
        if wait:
            self.wait_ready([server])
        return server

    def wait_ready(self, servers: Sequence[ServerProcess]) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        for server in servers:
            result = read_ready_line(server.proc.stdout, max(deadline - time.monotonic(), 0.1))
            if not result:
                err = server.log_path.read_text()[-3000:] if server.log_path else ""
                raise RuntimeError(f"server did not become ready: {' '.join(server.args)}\n{err}")
            server.ready = result

    def start(self, ranges: Sequence[BlockRange]) -> "LocalSwarm":
        try:
            if self.with_dht:
                self.start_dht()
            started = [self.start_server(r, wait=False) for r in ranges]
            self.wait_ready(started)
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self, server: ServerProcess, sig: int = signal.SIGKILL) -> None:
        """SIGKILL takes the server's whole process group (as a machine dying would); SIGTERM asks it to stop."""
        if sig == signal.SIGKILL:
            _kill_group(server.proc)
        elif server.alive:
            server.proc.send_signal(sig)

    def stop(self, timeout_s: float = 15.0) -> None:
        procs = [s.proc for s in self.servers] + self.dht_nodes
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
            _kill_group(p)  # whatever it left behind in its group (p2pd daemons)
            _LIVE.discard(p)
            if p.stdout:
                p.stdout.close()

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers if s.alive]

    def __enter__(self) -> "LocalSwarm":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
