"""`swarmlm api` as a child process (for `swarmlm demo --api`, the tests and the benchmark), always stopped."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Sequence

from swarmlm.swarm.local import read_ready_line


class GatewayProcess:
    def __init__(self, model: str, initial_peers: Sequence[str], extra: Sequence[str] = (), threads: int = 1,
                 log_path: str | Path | None = None) -> None:
        self.args = [sys.executable, "-m", "swarmlm.cli.main", "api", "--model", model, "--port", "0",
                     "--threads", str(threads), "--initial-peers", *initial_peers, *extra]
        self.log_path = Path(log_path or tempfile.mkstemp(prefix="swarmlm-api-", suffix=".err")[1])
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.model = ""  # the served model id, from the ready line

    def start(self, timeout_s: float = 180.0) -> "GatewayProcess":
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=open(self.log_path, "w"),
                                     stdin=subprocess.DEVNULL, text=True, env=env, start_new_session=True)
        ready = read_ready_line(self.proc.stdout, timeout_s)
        if not ready:
            self.stop()
            raise RuntimeError(f"the gateway did not start: {' '.join(self.args)}\n{self.log_path.read_text()[-3000:]}")
        self.url, self.model = ready["url"], ready.get("model", "")
        deadline = time.monotonic() + timeout_s
        while True:  # the port is bound before uvicorn serves: wait for an answer
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5):
                    return self
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"the gateway did not answer:\n{self.log_path.read_text()[-3000:]}")
                time.sleep(0.2)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever is left of its group
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(5)
        if self.proc.stdout:
            self.proc.stdout.close()
        self.proc = None

    def __enter__(self) -> "GatewayProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
