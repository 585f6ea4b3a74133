"""A step lane: the plain decode steps of a lone keyed session taken by a thread that blocks on the session's socket
(kernels/lane.c): on a packed span, read, computed and answered in one C call per step, with no event loop and no
Python between the socket and the kernel; on blocks transformers runs, the stage's forward between two C calls
(docs/ARCHITECTURE.md, "The step lane").

Why: a SmolLM2 decode step costs a server ~1 ms in the kernel and ~0.3 ms of CPU in Python around it (cold caches
after the kernel; docs/RESULTS-hop.md round 19): the frame's cut, MAC, inbox, stream loop, checks, scheduler, stage,
decoder, ANSWER. Round 20's lane, called from the event loop's `data_received`, still paid the loop's wake-up and
~70 us of cold Python around its C call per hop (docs/RESULTS-hop.md round 21): the thread that computes now also
waits on the socket that feeds it.

How: after a compact step of its session was answered the usual way, the session's stream arms a lane on its framed
connection when every rule the usual path applies to the next steps is known to hold until something changes
(`SessionStreams._arm`, `SwarmService.lane_for`): a keyed framed session, alone on this server, nothing queued,
held or unsent, its span a `SpanDecoder`'s with a rotary table, its caches grown to its max_length, its dims within
every limit at max_length. The connection stops reading (`FrameConnection.arm`) and the lane's thread reads the
socket: C checks that the bytes are exactly one STEP frame of the session's next step id with the MAC of the
session's client key, its dims, room and finite values, runs the span's decode on the session's caches and sends
the ANSWER with the server key. Anything else (another frame kind or size, a bad MAC, a wrong id, a NaN, the end of
the lane's room, a stalled frame, the peer's end) stops the thread having changed nothing, and the bytes it read go
the usual way, which answers or refuses them exactly as before. Whatever else may touch the session (another
session's open, a push into it, its close or detach, the connection's end, a compute of any other work: the
scheduler's `yield_lane`) disarms the lane first (`disarm`): the thread stops (a step it computes ends first), its
state (position, cache length, mask, step order, last use, counts) is written back, so the usual path goes on from
where the lane left it.

On a kept route (protocol 4, docs/PROTOCOL.md "Kept routes"): a session whose stream keeps a route has a lane that
pushes each output on as a PUSH_STEP from its thread, first, on a push connection of its own while armed (`PushOn`);
a session fed by pushes has its lane on the push connection its last PUSH_STEP came by (`reads_pushes`: C checks the
session's id, secret and push key's MAC), answering on the session's stream, which a message of its own disarms.
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import threading
import time

import numpy as np
import torch

from swarmlm.kernels import library
from swarmlm.kernels.frame_types import (ANSWER_OVERHEAD, FRAME_HEADER, MAC, STEP_HEAD, FrameKey, StepHead,
                                         push_step_overhead)
from swarmlm.kernels.lane import DECLINED, ENDED, FRAME, STOPPED, UNSENT, LaneIO
from swarmlm.wire import compact

log = logging.getLogger(__name__)

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_VALUES_AT = FRAME_HEADER + STEP_HEAD  # a STEP frame's values
# a begun frame's rest comes within a round trip or two; one slower than this is the usual path's (its stall timer)
_BEGUN_FRAME_S = 1.0


class _LaneState(ctypes.Structure):
    """kernels/lane.c's `struct lane`."""

    _fields_ = [("client", FrameKey), ("server", FrameKey), ("dims", _ptr), ("blocks", _ptr), ("n_blocks", _i64),
                ("x", _ptr), ("rows", _i64), ("hidden", _i64), ("kbase", _ptr), ("vbase", _ptr),
                ("layer_stride", _ptr), ("cap", _ptr), ("len", _ptr), ("mask_rows", _ptr), ("mask", _ptr),
                ("positions", _i64), ("rope", _ptr), ("rope_rows", _i64), ("next_id", _i64), ("position", _i64),
                ("steps", _i64), ("last_s", ctypes.c_double), ("from_push", _i64), ("push_in", FrameKey),
                ("secret", ctypes.c_char_p), ("push_out", FrameKey), ("out_secret", ctypes.c_char_p),
                ("out_next_id", _i64), ("push_frame", _ptr)]


class PushOn:
    """Where a lane pushes each step's output (a kept route, server/push.py KeptRoute): the route, the next
    session's push key (opened), and the push connection to its server, the lane's alone while it is armed."""

    __slots__ = ("route", "key", "conn")

    def __init__(self, route, key: bytes, conn) -> None:
        self.route, self.key, self.conn = route, key, conn


def _address(array) -> int:
    return ctypes.cast(array, _ptr).value


def _socket_of(transport) -> int:
    return transport.get_extra_info("socket").fileno()


class StepLane:
    """One armed session's lane. `start(conn)` hands it its connection's reads: a thread of its own blocks on the
    socket and takes each plain decode step (`lane_serve`: the whole step in one C call with a `decoder`, a packed
    span; else `lane_next`, the stage's own `step`, `lane_reply`) until something else comes or `disarm` stops it.
    Either way `disarm` writes its state back and the connection goes on the usual way from the bytes the lane read
    and did not take (`FrameConnection.lane_stopped`)."""

    def __init__(self, service, session, order, decoder=None, push_on: PushOn | None = None,
                 reads_pushes: bool = False) -> None:
        """`push_on`: each step's output also goes on as a PUSH_STEP (a route the session keeps). `reads_pushes`: the
        lane takes the PUSH_STEPs of a push connection into the session (`start`'s `conn`), not the STEPs of its
        stream, whose connection it writes the ANSWERs to."""
        state = session.state
        cache = state.cache
        rows, position, positions = state.rows, state.position, int(session.max_length)
        stage, self.scheduler = service.stage, service.scheduler
        self.session, self.order, self._service, self.rows = session, order, service, rows
        self._cache, self._state, self._stage, self._decoder = cache, state, stage, decoder
        self._start = position
        hidden = int(stage.hidden_size)
        self._x = torch.empty(rows, hidden, dtype=torch.float32)
        # a forward of transformers' longer than this: the usual path's turn (its inline rule: the compute thread)
        self._max_forward_s = service.config.scheduler.inline_decode_max_s
        if decoder is not None:
            if cache.capacity < positions:  # (grown once, to the session's reservation: the lane never grows it)
                cache._grow(positions, torch.empty(rows, decoder.kv_heads, 1, decoder.head_dim))
            keys, values, strides, caps, lengths, mask_rows = decoder._cache_rows([(cache, slice(0, rows))], 1)
            self._mask = torch.zeros(rows, positions, dtype=torch.int64)
            self._mask[:, :position] = state.mask
            table = decoder.rope_table(self._x, positions)
            # the kernel reads through these pointers: everything they point into stays alive with the lane
            self._held = (decoder, keys, values, strides, caps, lengths, mask_rows, table)
            kernel = (ctypes.cast(ctypes.byref(decoder.dims), _ptr), ctypes.cast(decoder.blocks, _ptr),
                      len(decoder.blocks), self._x.data_ptr(), rows, hidden, _address(keys), _address(values),
                      _address(strides), _address(caps), _address(lengths), _address(mask_rows),
                      self._mask.data_ptr(), positions, table.data_ptr(), int(table.shape[1]))
        else:
            self._ones = torch.ones(rows, 1, dtype=torch.int64)  # (the step's padding mask: none)
            kernel = (None, None, 0, self._x.data_ptr(), rows, hidden, None, None, None, None, None, None, None,
                      positions, None, positions)
        sid = session.session_id
        self.push_on, self.reads_pushes = push_on, reads_pushes
        push_in = FrameKey.of(session.keys.push, sid) if reads_pushes else FrameKey()
        if push_on is not None:
            target = push_on.route.target
            push_out = FrameKey.of(push_on.key, target.session_id)
            self._push_frame = ctypes.create_string_buffer(push_step_overhead(target.session_id) + 4 * rows * hidden)
            pushing = (push_out, target.secret, target.step_id, ctypes.addressof(self._push_frame))
        else:
            self._push_frame = None
            pushing = (FrameKey(), None, 0, None)
        self._state_c = _LaneState(
            FrameKey.of(session.keys.client, sid), FrameKey.of(session.keys.server, sid),
            *kernel, order.last_id + 1, position, 0, session.last_used_s, int(reads_pushes), push_in,
            session.secret if reads_pushes else None, *pushing)
        self._held_keys = (push_in, pushing[0])  # (the structs' copies point into these)
        frame_in = push_step_overhead(sid) if reads_pushes else _VALUES_AT + MAC  # one STEP or PUSH_STEP frame
        self._values_at = frame_in - MAC  # where its values start
        self._in = ctypes.create_string_buffer(frame_in + 4 * rows * hidden)
        self._out = ctypes.create_string_buffer(ANSWER_OVERHEAD + 4 * rows * hidden)
        self._ref = ctypes.byref(self._state_c)
        self._io = LaneIO(-1, -1, _BEGUN_FRAME_S, 0, 0, 0, 0, -1, -1, 0, 0)
        self._io_ref = ctypes.byref(self._io)
        lib = library()
        self._serve, self._next, self._reply = lib.lane_serve, lib.lane_next, lib.lane_reply
        self.armed = True
        self._conn = None
        self._answer_conn = None  # (reads_pushes) the session's stream's connection, where ANSWERs go
        self._fds: list[int] = []  # the thread's own duplicates of the sockets (closed after it stops)
        self._thread: threading.Thread | None = None
        self._wake_w = -1  # written to stop the thread (its read end is the thread's io.wake_fd)
        self._ended = 0  # why the thread stopped (kernels/lane.py STOPPED, DECLINED, ...): set by the thread

    # ---- the loop's side ----------------------------------------------------------------------------------------
    def start(self, conn, sock_fd: int, answer_conn=None) -> None:
        """The connection's reads are the lane's from now (its event loop reads none until `lane_stopped`): the
        thread starts on a duplicate of `sock_fd` (the loop's transport may close its own meanwhile: no descriptor
        the thread holds is ever another socket's). `answer_conn`: where ANSWERs go when that is another connection
        (a lane that reads pushes writes to the session's stream); its push connection's socket is duplicated too."""
        sockets = [sock_fd]
        if answer_conn is not None:
            sockets.append(_socket_of(answer_conn.transport))
        if self.push_on is not None:
            sockets.append(_socket_of(self.push_on.conn.transport))
        wake_r, wake_w = os.pipe()  # (OSError, out of descriptors: nothing started, the caller goes on without)
        fds: list[int] = []
        try:
            for fd in sockets:
                fds.append(os.dup(fd))
        except OSError:
            for fd in [wake_r, wake_w, *fds]:
                os.close(fd)
            raise
        self._fds = fds
        io = self._io
        io.fd, io.wake_fd, self._wake_w = fds[0], wake_r, wake_w
        io.answer_fd = fds[1] if answer_conn is not None else fds[0]
        io.push_fd = fds[-1] if self.push_on is not None else -1
        self._conn, self._answer_conn = conn, answer_conn
        self._loop = asyncio.get_running_loop()
        self.scheduler.lane = self
        self.session.lane = self
        self._thread = threading.Thread(target=self._run, name="swarmlm-step-lane", daemon=True)
        self._thread.start()

    @property
    def steps(self) -> int:
        """Steps taken since armed (each counted before its ANSWER is sent)."""
        return self._state_c.steps

    @property
    def last_step_s(self) -> float:
        """When its last step ended (time.monotonic; its arming's session.last_used_s before any)."""
        return self._state_c.last_s

    def disarm(self) -> None:
        """Back to the usual path (idempotent; on the loop's thread): the thread stopped (a step it is computing ends
        first), the session's cache length, mask, step order and last use written back as the lane left them, its
        counts added to the service's, and the connection told what the thread read and did not take, or did not
        send."""
        if not self.armed:
            return
        self.armed = False
        thread = self._thread
        if thread is not None:
            os.write(self._wake_w, b"x")
            thread.join()
            os.close(self._wake_w)
            os.close(self._io.wake_fd)
            for fd in self._fds:
                os.close(fd)
        c = self._state_c
        if c.steps:
            if self._decoder is not None:  # (the stage's own step commits as it goes)
                self._cache.commit(c.position - self._start)
                self._state.mask = self._mask[:, :c.position].clone()
            self.order.last_id = c.next_id - 1
            self.session.last_used_s = c.last_s
            self._service.tokens_computed += self.rows * c.steps  # (Info's counter)
            self.scheduler.lane_steps_done += c.steps
        if self.scheduler.lane is self:
            self.scheduler.lane = None
        if self.session.lane is self:
            self.session.lane = None
        push_on = self.push_on
        if push_on is not None:
            push_on.route.target.step_id = c.out_next_id  # (the route's next id, as its pushes left it)
        if self._conn is not None:
            io = self._io
            # a push not wholly written (its ANSWER not begun): its rest first, on its own connection, then the ANSWER
            if io.push_size and push_on is not None and not push_on.conn.transport.is_closing():
                push_on.conn.transport.write(self._push_frame.raw[io.push_sent:io.push_size])
            unsent = self._out.raw[io.sent:io.size] if self._ended in (UNSENT, ENDED) and io.size else b""
            if self._answer_conn is not None:  # (the stream's connection: written now, before anything else)
                if unsent and not self._answer_conn.transport.is_closing():
                    self._answer_conn.transport.write(unsent)
                unsent = b""
            self._conn.lane_stopped(self, self._in.raw[:io.got], unsent)
        if push_on is not None:  # (its push connection back to the pusher's, for the usual path's pushes)
            self._service.pusher.framed.keep(push_on.route.target.address, push_on.conn)

    # ---- the lane's thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self._decoder is not None:
                self._ended = self._serve(self._ref, self._io_ref, self._in, self._out)
            else:
                self._ended = self._serve_forward()
        except Exception:  # (a bug: the usual path takes what the lane read, as if it had declined it)
            log.exception("the step lane failed; its session goes on the usual way")
            self._ended = DECLINED
        if self._ended != STOPPED:  # (stopped: the loop is in `disarm`, waiting for this thread)
            try:
                self._loop.call_soon_threadsafe(self.disarm)
            except RuntimeError:  # (the loop is closed: the server is gone)
                pass

    def _serve_forward(self) -> int:
        """Blocks transformers runs: C reads and checks each STEP (or PUSH_STEP), the stage computes (and commits), C
        answers (and pushes on)."""
        step_head = ctypes.byref(StepHead())
        x, ones, state = self._x, self._ones, self._state
        values = x.numpy()
        values_at = self._values_at
        while True:
            ended = self._next(self._ref, self._io_ref, self._in, step_head)
            if ended != FRAME:
                return ended
            t0 = time.perf_counter()
            values[:] = np.frombuffer(self._in, np.float32, x.numel(), values_at).reshape(x.shape)
            out = self._stage.step(state, x.view(x.shape[0], 1, -1), ones)
            compute_s = time.perf_counter() - t0
            if compute_s > self._max_forward_s:  # (the next steps go to the compute thread: the usual path's rule)
                self._max_forward_s = 0.0
            # (the output's own memory when it is float32 in C order already: no array object made, after a forward)
            ready = out.dtype is torch.float32 and not out.requires_grad and out.is_contiguous()
            ended = self._reply(self._ref, self._io_ref, out.data_ptr() if ready else
                                compact.float32_values(out).ctypes.data, compute_s, 0.0, self._out)
            if ended:
                return ended
            if self._max_forward_s <= 0:  # (that forward was too long for the lane: the usual path's rule)
                return DECLINED
