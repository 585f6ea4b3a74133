"""A relayed decode step's hops in one C call (kernels/chain.c `chain_relay`): the STEP of each hop built, written,
its ANSWER read and checked (kind, length, MAC under the server key, step id), its values on to the next hop, without
Python between the sockets. Right after each wait every Python call costs 10-30x a warm one (docs/RESULTS-hop.md
round 18): the Python the hops cost is what kept a 3-server route's decode below a 1-server one's.

`RelayChain` holds the route's streams as C sees them (sockets, keys, session ids), made once per route and kept by
the session while the route's streams stay; `run` is one step. Only a plain decode step on framed keyed streams goes
here (`StepPipeline.run_blocking` decides, `relayable`); whatever the chain does not take as the expected ANSWER
stops it at that hop, and the Python reader takes over from there, the bytes read so far handed back to it
(`Stopped`). The caller does each hop's bookkeeping from what `run` returns (`take_answered`).

A pushed decode step on a kept route (docs/PROTOCOL.md "Kept routes": one STEP to the first server, each server
pushing on to the next) runs the same way (`run(..., pushed=True)`, kernels/chain.c `chain_pushed`): hop 0's STEP
written, one sleep until the last hop's answer, every hop's ANSWER taken as a relayed one is; the Python reader takes
over where it stops. Without it the pushed step's hops cost the client more Python than a relayed step's.

`RelayLane` is a session's relayed (or kept-route pushed) decode steps while nothing the usual path decides about
them changes: armed by the session after a decode step the chain answered whole, a step is then the chain's one call
and each hop's bookkeeping, none of the usual step's per-hop checks and objects (after a wait every Python call is
cold: docs/RESULTS-hop.md round 20)."""
from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

import torch

from swarmlm.client.streams import RelayedHop, SpanStream
from swarmlm.kernels import KernelUnavailable, library
from swarmlm.kernels.frame_types import ANSWER_OVERHEAD, FRAME_HEADER, MAC, STEP_HEAD, FrameKey
from swarmlm.small_reads import no_padding_mask

log = logging.getLogger(__name__)

_i64, _f64 = ctypes.c_int64, ctypes.c_double
INTS, TIMES = 4, 8  # per hop: chain.c's CHAIN_INTS, CHAIN_TIMES
MAX_PUSHED = 65  # chain.c's CHAIN_MAX_PUSHED: the hops chain_pushed takes (a step's 64 push targets and its first)
WRITE_TIMEOUT, WRITE_ERROR, READ = 1, 2, 3  # chain.c's stop states (0: every hop answered)


@functools.lru_cache(maxsize=1)
def chain_library() -> ctypes.CDLL | None:
    """The kernels with chain_relay and chain_pushed, or None if this process cannot build them (decode steps then
    run their hops in Python, as fast as before this chain)."""
    try:
        return library()
    except KernelUnavailable as exc:
        log.info("%s; relayed decode steps run their hops in Python", exc)
        return None


class ChainHop(ctypes.Structure):
    _fields_ = [("fd", _i64), ("client", FrameKey), ("server", FrameKey), ("max_body", _i64),
                ("step_id", ctypes.c_uint64), ("bound_s", _f64)]


class ChainStep(ctypes.Structure):
    _fields_ = [("n", _i64), ("b", _i64), ("t", _i64), ("h", _i64), ("step", ctypes.c_void_p),
                ("reply", ctypes.c_void_p), ("ints", ctypes.c_void_p), ("times", ctypes.c_void_p),
                ("stop", ctypes.c_void_p)]


@dataclass
class Stopped:
    """Where the chain stopped short of the last hop: hop `hop` (the hops before it answered), its STEP `state`
    (WRITE_TIMEOUT, WRITE_ERROR: not wholly written; READ: written, its reply the Python reader's, `got` its bytes
    read so far), `errno` of a failed send / recv (0: none), when its STEP's build and write began (`built_s`,
    `written_s`: perf_counter; a pushed hop j > 0: hop 0's write) and the reply's time left of its bound (`left_s`)."""

    hop: int
    state: int
    errno: int
    got: bytes
    built_s: float
    written_s: float
    left_s: float


class RelayChain:
    """A route's streams for chain_relay and chain_pushed (sockets, keys, session ids: fixed while the streams are)."""

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
        self._shape: torch.Size | None = None  # the step shape the frame buffers and output block are for
        self._step = self._reply = None
        self._outputs: OutputBlock | None = None

    def fits(self, streams: list[SpanStream]) -> bool:
        """Is this the chain of these streams, on the same calls still?"""
        if len(streams) != len(self.streams):
            return False
        for s, mine, call in zip(streams, self.streams, self.calls):
            if s is not mine or s.call is not call:
                return False
        return True

    def run(self, x: torch.Tensor, bounds: list[float] | None = None,
            pushed: bool = False) -> tuple[int, tuple[torch.Tensor, ...], Stopped | None]:
        """One step: x [B, T, H] float32, contiguous; bounds: each hop's hang timeout (None: the last step's, its
        step ids advanced by the chain: a relay lane's step, right after a whole one); pushed: on the route hop 0's
        server keeps (chain_pushed), else relayed. Returns the hops answered, every hop's output [B, T, H] (valid for
        those answered: tensors of their own, written by no later step), and where it stopped (None: every hop
        answered). Each hop's step id is its stream's next (the caller's bookkeeping takes it)."""
        shape = x.shape
        if shape != self._shape:
            self._shape = shape
            b, t, h = shape
            count = b * t * h
            self._step = ctypes.create_string_buffer(FRAME_HEADER + STEP_HEAD + 4 * count + MAC)
            self._reply = ctypes.create_string_buffer(ANSWER_OVERHEAD + 4 * count)
            self._call = ChainStep(len(self.streams), b, t, h,
                                   *map(ctypes.addressof, (self._step, self._reply, self.ints, self.times, self.stop)))
            self._call_at = ctypes.addressof(self._call)
            self._outputs = OutputBlock(shape, len(self.streams))
        n = len(self.streams)
        if bounds is not None:
            for hop, stream, bound in zip(self.hops, self.streams, bounds):
                hop.step_id = stream._step_id + 1
                hop.bound_s = bound
        hop_outs, outs_at = self._outputs.take()
        # (addresses as ints: ctypes converts an int at once, an array through its from_param)
        chain = self.lib.chain_pushed if pushed else self.lib.chain_relay
        done = chain(self._hops_at, self._call_at, x.data_ptr(), outs_at)
        self.answered += done
        if done == n:
            return done, hop_outs, None
        _, state, errno, got = self.stop[:]
        times = self.times[TIMES * done:TIMES * done + 8]
        # (READ: the reply's bound began with its read, times[7], and went until the chain stopped, times[6])
        left = self.hops[done].bound_s - (times[6] - times[7])
        return done, hop_outs, Stopped(done, state, errno, self._reply.raw[:got], times[4], times[5], left)


class OutputBlock:
    """The chain's output tensors, made ahead in blocks: each step takes the next n (one per hop, [B, T, H] each,
    adjacent in memory: chain_relay writes hop j's at the address + j * B*T*H floats), no torch call of its own.
    Right after the wait every torch call costs ~10x a warm one (tens of us: docs/RESULTS-hop.md round 20), and
    a step's `torch.empty` and `unbind` were two of them; a block's are one `empty` and one `unbind` per
    BLOCK_BYTES of outputs. A tensor handed out is never written again; a kept one keeps its block's memory."""

    BLOCK_BYTES = 1 << 18  # 256 KiB: 64 decode steps of a 1024-wide model through one server

    def __init__(self, shape: torch.Size, n: int) -> None:
        self.shape, self.n = shape, n
        self.step_bytes = 4 * n * shape[0] * shape[1] * shape[2]
        self.steps = max(1, self.BLOCK_BYTES // self.step_bytes)  # steps a block holds
        self._outs: tuple[torch.Tensor, ...] = ()
        self._next = 0  # the next step's first tensor in _outs
        self._at = 0  # its address

    def take(self) -> tuple[tuple[torch.Tensor, ...], int]:
        """The next step's n output tensors, and the address of the first."""
        k, n = self._next, self.n
        if k == len(self._outs):
            block = torch.empty((self.steps * n, *self.shape), dtype=torch.float32)
            self._outs, k, self._at = block.unbind(0), 0, block.data_ptr()
        self._next = k + n
        at, self._at = self._at, self._at + self.step_bytes
        return self._outs[k:k + n], at


def take_answered(open_spans: list, x: torch.Tensor, mask: torch.Tensor, outs: tuple[torch.Tensor, ...],
                  ints: list[int], times: list[float], nbytes: int, n_tokens: int,
                  pushed: bool = False) -> list[RelayedHop]:
    """The bookkeeping of the hops a chain answered (as many as `ints` holds records of: ints and times read whole
    from the chain): each stream's step id, position and timing (SpanStream.relayed), each span's history (its
    input, then the next hop's, is the previous hop's output). `open_spans`: the route's (client/pipeline.py
    OpenSpan, which sits above this module); `nbytes`, `n_tokens`: x's float32 bytes and tokens (the caller's: a
    lane's are fixed, no torch call to ask x); `pushed`: the hops after the first had their step pushed there
    (chain_pushed). Returns their timings in order, not made yet (streams.py `relayed_timing` makes them)."""
    timings = []
    source = x
    for j in range(len(ints) // INTS):
        open_span = open_spans[j]
        timings.append(open_span.stream.relayed(ints[INTS * j:INTS * (j + 1)], times[TIMES * j:TIMES * (j + 1)], nbytes,
                                                n_tokens, pushed_here=pushed and j > 0))
        open_span.answered(source, mask, n_tokens)
        source = outs[j]
    return timings


class RelayLane:
    """A session's relayed decode steps while the usual path would decide each of them as it decided the one that
    armed it: the same spans and streams (no failover, nothing in flight or read ahead on any), the same view of the
    servers (the hang bounds come from their records) and of the links (push, RemoteSequence.push: decided anew only
    when the router syncs), a fixed wire format, the same [B, 1, H] float32 input. `takes` checks exactly that; then
    `step` is the chain's call and `take_answered`. Where the chain stops short, the caller goes on the usual way
    from there (its result in hand): a failure is handled as ever, and the lane is gone until a whole step arms it.
    `pushed`: the steps go on the route the first server keeps (chain_pushed); each whole one takes that route one
    step on (`SpanStream.went_on_route`, as the usual path's would): nothing else writes to a stream while its
    session's lane lasts, so the route stays the one the next STEP goes on."""

    def __init__(self, session, chain: RelayChain, shape: torch.Size, pushed: bool = False) -> None:
        # (session: the client/session.py InferenceSession that arms it, above this module)
        self.session = session
        self.chain = chain
        self.spans = session.spans  # (the list itself: a failover or reopen makes a new one)
        self.view, self.router = session.remote.view, session.remote.router
        self.records, self.syncs = self.view.records, self.router.syncs  # (the view replaces its dict on a read)
        self.shape = shape
        self.mask = no_padding_mask(shape[0], shape[1])  # (the one a decode step's history keeps)
        self.nbytes, self.n_tokens = 4 * shape.numel(), shape[1]
        # steps left before the session's max_length (the usual path's check; only a lane step moves the position
        # while the lane lasts, one token each)
        self.left = session.max_length - session.position
        self.calls = list(zip(chain.streams, chain.calls))
        self.pushed = pushed
        self.first = chain.streams[0]

    @classmethod
    def arm(cls, session, chain: RelayChain, x: torch.Tensor, pushed: bool = False) -> RelayLane | None:
        """After `x`'s decode step went whole through `chain` (its hang bounds set there, its step ids advanced;
        `pushed`: on a kept route): a lane for the next ones, or None where a link's wire format is chosen per
        message (auto-lossy: by its measured bandwidth)."""
        if session.remote.channels.wire_dtype == "auto-lossy":
            return None
        return cls(session, chain, x.shape, pushed)

    def takes(self, x: torch.Tensor) -> bool:
        """Would the usual path relay this step ([B, 1, H], no mask or cache op: the caller's) in this chain, with
        these bounds (and not refuse it: room left in the session)?"""
        if self.left <= 0 or x.shape != self.shape or x.dtype is not torch.float32 or not x.is_contiguous():
            return False
        session = self.session
        if session.spans is not self.spans or self.view.records is not self.records or self.router.syncs != self.syncs:
            return False
        for stream, call in self.calls:  # (a loop, not all(): no generator frame per step)
            if stream.call is not call or call._buf or not stream.blocking_ok:  # (the usual path's own rules)
                return False
        return True

    def step(self, x: torch.Tensor) -> tuple[list[RelayedHop], tuple[torch.Tensor, ...], tuple | None]:
        """One step through the chain: the answered hops' timings not made yet (their bookkeeping done: the step's
        record makes them when read, session.py LaneStepRecord), every hop's output, and None, or where it stopped
        (the chain's result: the caller goes on the usual way from it, nothing of it taken here)."""
        pushed = self.pushed
        result = self.chain.run(x, None, pushed)  # (the bounds and step ids the arming step left in it)
        done, outs, stopped = result
        if stopped is not None:
            return [], outs, result
        self.left -= 1
        if pushed:
            self.first.went_on_route()
        ints, times = self.chain.ints[:], self.chain.times[:]  # (whole, once: every hop answered)
        return take_answered(self.spans, x, self.mask, outs, ints, times, self.nbytes, self.n_tokens, pushed), outs, \
            None
