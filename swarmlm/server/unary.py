"""One admission path for the server's unary RPCs (Forward, Backward, Info, Push) and one error-to-status map.

A call passes `UnaryGate.serve`: a message that does not parse, a check that fails, a peer over its bytes in flight,
a full budget or a bug each become the status `STATUS` gives their error class, with the error's message; the
bytes the call charged to its peer are released when it ends, whatever happened. Refusals are returned, not raised:
an exception's traceback would keep the request's frame, and its buffers, alive until the garbage collector runs.
"""
from __future__ import annotations

import ctypes
import gc
import logging
import time
from typing import Awaitable, Callable

import grpc

from swarmlm.errors import CapacityExceeded, InvalidRequest, NotPermitted, UnknownSession
from swarmlm.server.checks import peer_host
from swarmlm.server.inbound import UNPARSABLE
from swarmlm.server.sessions import PeerBytes

log = logging.getLogger(__name__)

# the one map from an error class to the status a peer sees (the stream's first message uses it too); anything
# else is a bug or an OOM: INTERNAL
STATUS: dict[type[Exception], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    CapacityExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    UnknownSession: grpc.StatusCode.NOT_FOUND,
    NotPermitted: grpc.StatusCode.PERMISSION_DENIED,
}


def status_of(exc: BaseException) -> grpc.StatusCode:
    return next((STATUS[cls] for cls in type(exc).__mro__ if cls in STATUS), grpc.StatusCode.INTERNAL)


def message_of(exc: BaseException) -> str:
    """The error's own words (a KeyError's str() would quote them)."""
    return str(exc.args[0]) if len(exc.args) == 1 else str(exc)


def refuse(context, exc: BaseException, reply, what: str = ""):
    """`reply` with the status and message of `exc` set on the call (an unexpected error: "<what> failed: ...")."""
    code = status_of(exc)
    context.set_code(code)
    context.set_details(message_of(exc) if code != grpc.StatusCode.INTERNAL else f"{what} failed: {exc}")
    return reply


class Trimmer:
    """Return freed heap to the OS (at most once a second): glibc keeps freed blocks of the arena a thread used, and
    the refused messages of a loop were measured to stack up there (docs/FAILURES.md)."""

    def __init__(self) -> None:
        try:
            self._libc = ctypes.CDLL("libc.so.6")
        except OSError:  # not glibc: nothing to trim
            self._libc = None
        self._last = 0.0

    def __call__(self) -> None:
        now = time.monotonic()
        if now - self._last < 1.0:
            return
        self._last = now
        gc.collect()
        if self._libc is not None:
            self._libc.malloc_trim(0)


class Admission:
    """What one unary call holds here: bytes charged to its peer (ServerConfig.max_peer_bytes_in_flight)."""

    def __init__(self, load: PeerBytes, peer: str) -> None:
        self.load, self.peer, self.nbytes = load, peer, 0

    def charge(self, nbytes: int) -> None:
        """Count `nbytes` against the peer's bytes in flight, or CapacityExceeded (nothing charged)."""
        if not self.load.try_add(self.peer, nbytes):
            raise CapacityExceeded(f"peer {self.peer} has {self.load.limit} bytes in flight here")
        self.nbytes += nbytes

    def release(self) -> None:
        if self.nbytes:
            self.load.release(self.peer, self.nbytes)
            self.nbytes = 0


Handler = Callable[[object, Admission], Awaitable[object]]


class UnaryGate:
    """The one path of every unary RPC: parse check, the handler (which validates, charges and computes), the
    refusal from STATUS, the peer's bytes released. A refused request of at least `trim_bytes`
    (ServerConfig.trim_refused_bytes) hands freed memory back to the OS."""

    def __init__(self, load: PeerBytes, trim_bytes: int) -> None:
        self.load, self.trim_bytes = load, trim_bytes
        self.trim = Trimmer()

    async def serve(self, request, context, empty, what: str, handle: Handler):
        """`handle(request, admission)` -> the reply, or an error that becomes `empty` with its status."""
        if request is UNPARSABLE:
            return refuse(context, InvalidRequest("the request does not parse"), empty)
        admission = Admission(self.load, peer_host(context))
        try:
            return await handle(request, admission)
        except Exception as exc:  # the mapped refusals, and INTERNAL for the rest
            return self._refused(request, context, exc, empty, what)
        finally:
            admission.release()

    def serve_now(self, request, context, empty, what: str, handle: Callable[[object, Admission], object]):
        """`serve` of a handler that answers without waiting: its reply (None: it would wait; nothing done)."""
        if request is UNPARSABLE:
            return refuse(context, InvalidRequest("the request does not parse"), empty)
        admission = Admission(self.load, peer_host(context))
        try:
            return handle(request, admission)
        except Exception as exc:
            return self._refused(request, context, exc, empty, what)
        finally:
            admission.release()

    def _refused(self, request, context, exc: Exception, empty, what: str):
        if status_of(exc) == grpc.StatusCode.INTERNAL:
            log.exception("%s failed", what)
        elif request.ByteSize() >= self.trim_bytes:
            self.trim()
        return refuse(context, exc, empty, what)
