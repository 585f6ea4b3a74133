"""Headless Chromium driven through the Chrome DevTools protocol over a pipe (`--remote-debugging-pipe`: JSON
messages ending in a NUL byte, read by Chromium on its fd 3 and written on its fd 4), so no websocket client is
needed. Enough for a test to open a page, type, click and read the DOM like a user."""
from __future__ import annotations

import fcntl
import json
import os
import queue
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("headless Chromium is needed for the browser tests: `make chromium` (apt-get install chromium)")
    return path


def _high_fd(fd: int) -> int:
    """A copy of fd numbered 10 or more (the child's fds 3 and 4 are then free to take), the original closed."""
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return high


class Browser:
    """One headless Chromium (killed with its process group on close) and one page of it."""

    def __init__(self, profile: Path, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        to_chrome_r, to_chrome_w = (_high_fd(fd) for fd in os.pipe())
        from_chrome_r, from_chrome_w = (_high_fd(fd) for fd in os.pipe())
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1280,900",
                 "--remote-debugging-pipe", "about:blank"]
        # bash moves the pipe ends to fds 3 and 4 (subprocess keeps fd numbers) and closes the originals
        redirect = f"3<&{to_chrome_r} 4>&{from_chrome_w} {to_chrome_r}<&- {from_chrome_w}>&-"
        self.proc = subprocess.Popen(["bash", "-c", f'exec "$0" "$@" {redirect}', chromium(), *flags],
                                     pass_fds=(to_chrome_r, from_chrome_w), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self.out = os.fdopen(to_chrome_w, "wb")
        self.replies: dict[int, queue.Queue] = {}
        self.lock = threading.Lock()
        self.next_id = 0
        threading.Thread(target=self._read, args=(os.fdopen(from_chrome_r, "rb"),), daemon=True).start()
        self.session = ""

    def _read(self, stream) -> None:
        buffer = b""
        while chunk := stream.read1(1 << 16):
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            for raw in messages:
                message = json.loads(raw)
                if "id" in message and message["id"] in self.replies:
                    self.replies[message["id"]].put(message)

    def call(self, method: str, session: str | None = None, **params) -> dict:
        """One command; its result, or an AssertionError with the protocol's error."""
        with self.lock:
            self.next_id += 1
            id_ = self.next_id
            self.replies[id_] = queue.Queue()
            message = {"id": id_, "method": method, "params": params}
            target = self.session if session is None else session  # "": the browser itself
            if target:
                message["sessionId"] = target
            self.out.write(json.dumps(message).encode() + b"\0")
            self.out.flush()
        try:
            reply = self.replies[id_].get(timeout=self.timeout_s)
        except queue.Empty:
            raise AssertionError(f"Chromium did not answer {method} within {self.timeout_s} s") from None
        finally:
            del self.replies[id_]
        assert "error" not in reply, (method, reply["error"])
        return reply["result"]

    def open(self, url: str) -> None:
        target = self.call("Target.createTarget", session="", url=url)["targetId"]
        self.session = self.call("Target.attachToTarget", session="", targetId=target, flatten=True)["sessionId"]

    def eval(self, expression: str):
        """A JavaScript expression's value in the page (a thrown exception fails the test)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 120.0, what: str = ""):
        """Polls a JavaScript expression until it is truthy; its value."""
        deadline = time.monotonic() + timeout_s
        while not (value := self.eval(expression)):
            assert time.monotonic() < deadline, f"timed out waiting for {what or expression}"
            time.sleep(0.1)
        return value

    def type_into(self, selector: str, text: str) -> None:
        """Focus the element, clear it, and type the text as keyboard input."""
        self.eval(f"(e => {{ e.focus(); e.value = ''; }})(document.querySelector({json.dumps(selector)}))")
        self.call("Input.insertText", text=text)

    def click(self, selector: str) -> None:
        """A left mouse click in the middle of the element, as a user's."""
        box = self.eval(f"(r => [r.x + r.width / 2, r.y + r.height / 2])"
                        f"(document.querySelector({json.dumps(selector)}).getBoundingClientRect())")
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)

    def close(self) -> None:
        try:
            self.out.close()
        except OSError:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its zygote and renderers
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
