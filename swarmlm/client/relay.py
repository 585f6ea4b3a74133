"""A relayed decode step's hops in one C call (kernels/chain.c `chain_relay`): the STEP of each hop built, written,
its ANSWER read and checked (kind, length, MAC under the server key, step id), its values on to the next hop, without
Python between the sockets. Right after each wait every Python call costs 10-30x a warm one (docs/RESULTS-hop.md
round 18): the Python the hops cost is what kept a 3-server route's decode below a 1-server one's.

`RelayChain` holds the route's streams as C sees them (sockets, keys, session ids), made once per route and kept by
the session while the route's streams stay; `run` is one step. Only a plain decode step on framed keyed streams goes
here (`StepPipeline.run_blocking` decides, `relayable`); whatever the chain does not take as the expected ANSWER
stops it at that hop, and the Python reader takes over from there, the bytes read so far handed back to it
(`Stopped`). The caller does each hop's bookkeeping from what `run` returns (SpanStream.relayed)."""
from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

import torch

from swarmlm.client.streams import SpanStream
from swarmlm.kernels import KernelUnavailable, library
from swarmlm.kernels.frame_types import ANSWER_OVERHEAD, FRAME_HEADER, MAC, STEP_HEAD, FrameKey

log = logging.getLogger(__name__)

_i64, _f64 = ctypes.c_int64, ctypes.c_double
INTS, TIMES = 4, 8  # per hop: chain.c's CHAIN_INTS, CHAIN_TIMES
WRITE_TIMEOUT, WRITE_ERROR, READ = 1, 2, 3  # chain.c's stop states (0: every hop answered)


@functools.lru_cache(maxsize=1)
def chain_library() -> ctypes.CDLL | None:
    """The kernels with chain_relay, or None if this process cannot build them (decode steps then run their hops
    in Python, as fast as before this chain)."""
    try:
        return library()
    except KernelUnavailable as exc:
        log.info("%s; relayed decode steps run their hops in Python", exc)
        return None


class ChainHop(ctypes.Structure):
    _fields_ = [("fd", _i64), ("client", FrameKey), ("server", FrameKey), ("max_body", _i64),
                ("step_id", ctypes.c_uint64), ("bound_s", _f64)]


@dataclass
class Stopped:
    """Where the chain stopped short of the last hop: hop `hop` (the hops before it answered), its STEP `state`
    (WRITE_TIMEOUT, WRITE_ERROR: not wholly written; READ: written, its reply the Python reader's, `got` its bytes
    read so far), `errno` of a failed send / recv (0: none), when its STEP's build and write began (`built_s`,
    `written_s`: perf_counter) and the reply's time left of its bound (`left_s`)."""

    hop: int
    state: int
    errno: int
    got: bytes
    built_s: float
    written_s: float
    left_s: float


class RelayChain:
    """A route's streams for chain_relay (sockets, keys, session ids: fixed while the streams are)."""

    def __init__(self, lib: ctypes.CDLL, streams: list[SpanStream]) -> None:
        self.lib = lib
        self.streams = streams
        self.calls = [s.call for s in streams]
        n = len(streams)
        self.hops = (ChainHop * n)()
        self._keys = []  # the FrameKeys whose bytes the hops' structs point into (a struct field holds a copy)
        for hop, stream in zip(self.hops, streams):
            client = FrameKey.of(stream.keys.client, stream.session_id)
            server = FrameKey.of(stream.keys.server, stream.session_id)
            self._keys += (client, server)
            hop.fd, hop.client, hop.server = stream.call._sock.fileno(), client, server
            hop.max_body = stream.call._max
        self.ints = (_i64 * (INTS * n))()
        self.times = (_f64 * (TIMES * n))()
        self.stop = (_i64 * 4)()
        self._hops_at = ctypes.addressof(self.hops)
        self.answered = 0  # hops the chain took the ANSWER of, over its steps (what the tests count)
        self._count = -1  # the values per step the frame buffers hold
        self._step = self._reply = None

    def fits(self, streams: list[SpanStream]) -> bool:
        """Is this the chain of these streams, on the same calls still?"""
        if len(streams) != len(self.streams):
            return False
        for s, mine, call in zip(streams, self.streams, self.calls):
            if s is not mine or s.call is not call:
                return False
        return True

    def run(self, x: torch.Tensor, bounds: list[float]) -> tuple[int, tuple[torch.Tensor, ...], Stopped | None]:
        """One step: x [B, T, H] float32, contiguous; bounds: each hop's hang timeout. Returns the hops answered, every
        hop's output [B, T, H] (valid for those answered), and where it stopped (None: every hop answered). Each hop's
        step id is its stream's next (the caller's bookkeeping takes it)."""
        b, t, h = x.shape
        count = b * t * h
        if count != self._count:
            self._count = count
            self._step = ctypes.create_string_buffer(FRAME_HEADER + STEP_HEAD + 4 * count + MAC)
            self._reply = ctypes.create_string_buffer(ANSWER_OVERHEAD + 4 * count)
            self._addresses = tuple(map(ctypes.addressof, (self._step, self._reply, self.ints, self.times,
                                                           self.stop)))
        n = len(self.streams)
        for hop, stream, bound in zip(self.hops, self.streams, bounds):
            hop.step_id = stream._step_id + 1
            hop.bound_s = bound
        outs = torch.empty((n, b, t, h))
        # (the buffers' addresses as ints: ctypes converts an int at once, an array through its from_param)
        step, reply, ints, times, stop = self._addresses
        done = self.lib.chain_relay(self._hops_at, n, b, t, h, x.data_ptr(), outs.data_ptr(), step, reply, ints,
                                    times, stop)
        self.answered += done
        if done == n:
            return done, outs.unbind(0), None
        _, state, errno, got = self.stop[:]
        times = self.times[TIMES * done:TIMES * done + 8]
        # (READ: the reply's deadline began when the STEP was written, its time read went until the chain stopped)
        left = bounds[done] - (times[6] - times[5])
        return done, outs.unbind(0), Stopped(done, state, errno, self._reply.raw[:got], times[4], times[5], left)
