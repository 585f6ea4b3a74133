"""A step lane: the plain decode steps of a lone keyed session taken as their frame arrives (kernels/lane.c): on a
packed span in one C call, with no Python between the socket and the kernel; on blocks transformers runs, the
stage's forward between two C calls (docs/ARCHITECTURE.md, "The step lane").

Why: a SmolLM2 decode step costs a server ~1 ms in the kernel and ~0.3 ms of CPU in Python around it (cold caches
after the kernel; docs/RESULTS-hop.md round 19): the frame's cut, MAC, inbox, stream loop, checks, scheduler, stage,
decoder, ANSWER. A 3-server token pays that 3 times, a 1-server token once.

How: after a compact step of its session was answered the usual way, the session's stream arms a lane on its framed
connection when every rule the usual path applies to the next steps is known to hold until something changes
(`SessionStreams._arm`, `SwarmService.lane_for`): a keyed framed session, alone on this server, nothing queued or
held, its span a `SpanDecoder`'s with a rotary table, its caches grown to its max_length, its dims within every
limit at max_length. The connection's `data_received` then hands each read to the lane first (`take`): C checks
that the bytes are exactly one STEP frame of the session's next step id with the MAC of the session's client key,
its dims, room and finite values, runs the span's decode on the session's caches and writes the ANSWER with the
server key; anything else (another frame kind, a partial or double frame, a bad MAC, a wrong id, a NaN, the end of
the lane's room) changes nothing and disarms the lane, and the bytes go the usual way, which answers or refuses them
exactly as before. Whatever else may touch the session (another session's open, a push into it, its close or
detach, the connection's end, a compute of any other work) disarms the lane first (`disarm`): its state (position,
cache length, mask, step order, last use) is written back, so the usual path goes on from where the lane left it.
"""
from __future__ import annotations

import ctypes
import time

import numpy as np
import torch

from swarmlm.kernels import library
from swarmlm.kernels.frame_types import ANSWER_OVERHEAD, FRAME_HEADER, STEP_HEAD, FrameKey, StepHead
from swarmlm.wire import compact

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_VALUES_AT = FRAME_HEADER + STEP_HEAD  # a STEP frame's values


class _LaneState(ctypes.Structure):
    """kernels/lane.c's `struct lane`."""

    _fields_ = [("client", FrameKey), ("server", FrameKey), ("dims", _ptr), ("blocks", _ptr), ("n_blocks", _i64),
                ("x", _ptr), ("rows", _i64), ("hidden", _i64), ("kbase", _ptr), ("vbase", _ptr),
                ("layer_stride", _ptr), ("cap", _ptr), ("len", _ptr), ("mask_rows", _ptr), ("mask", _ptr),
                ("positions", _i64), ("rope", _ptr), ("rope_rows", _i64), ("next_id", _i64), ("position", _i64),
                ("steps", _i64)]


def _address(array) -> int:
    return ctypes.cast(array, _ptr).value


class StepLane:
    """One armed session's lane. `take(data)`: its ANSWER frame, or None (the bytes go the usual way: `disarm`
    first). With a `decoder` (a packed span) the whole step is one C call; without one (blocks transformers runs) C
    checks the frame and writes the ANSWER, and the stage's own `step` computes in between (one Python call where
    the usual path makes ~the inbox, the stream loop, the service's checks, the scheduler)."""

    def __init__(self, service, session, order, decoder=None) -> None:
        state = session.state
        cache = state.cache
        rows, position, positions = state.rows, state.position, int(session.max_length)
        stage, self.scheduler = service.stage, service.scheduler
        self.session, self.order, self._service, self._rows = session, order, service, rows
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
        self._state_c = _LaneState(
            FrameKey.of(session.keys.client, session.session_id), FrameKey.of(session.keys.server, session.session_id),
            *kernel, order.last_id + 1, position, 0)
        self._out = ctypes.create_string_buffer(ANSWER_OVERHEAD + 4 * rows * hidden)
        self._ref = ctypes.byref(self._state_c)
        self._step_head = ctypes.byref(StepHead())
        lib = library()
        self._take, self._open, self._answer = lib.lane_take, lib.lane_open, lib.lane_answer
        self.armed = True

    def take(self, data: bytes) -> bytes | None:
        """The ANSWER to `data` if it is this session's next plain decode step (taken: computed, committed; the
        caller writes it, then calls `taken`), else None (nothing changed). Declines while the scheduler computes
        anything (its kernels' threads are one pool)."""
        if not self.scheduler.idle:
            return None
        if self._decoder is not None:
            if self._take(self._ref, data, len(data), self._out) <= 0:
                return None
        elif not self._forward(data):
            return None
        return self._out.raw

    def taken(self) -> None:
        """A taken step's bookkeeping, once its ANSWER is on its way (none of it is the client's wait)."""
        self.session.last_used_s = time.monotonic()  # (the expiry loop reads it)
        self._service.tokens_computed += self._rows  # (Info's counter)
        self.scheduler.lane_steps += 1

    def _forward(self, data: bytes) -> bool:
        """A step of blocks transformers runs: C checks the frame, the stage computes (and commits), C answers."""
        if self._max_forward_s <= 0 or not self._open(self._ref, data, len(data), self._step_head):
            return False
        t0 = time.perf_counter()
        x = self._x
        x.numpy()[:] = np.frombuffer(data, np.float32, x.numel(), _VALUES_AT).reshape(x.shape)
        out = self._stage.step(self._state, x.view(x.shape[0], 1, -1), self._ones)
        compute_s = time.perf_counter() - t0
        if compute_s > self._max_forward_s:  # (the next steps go to the compute thread: the usual path's rule)
            self._max_forward_s = 0.0
        # (the output's own memory when it is float32 in C order already: no array object made, right after a forward)
        ready = out.dtype is torch.float32 and not out.requires_grad and out.is_contiguous()
        self._answer(self._ref, out.data_ptr() if ready else compact.float32_values(out).ctypes.data, compute_s, 0.0,
                     self._out)
        return True

    def disarm(self) -> None:
        """Back to the usual path: the session's cache length, mask, step order and last use as the lane left them
        (idempotent)."""
        if not self.armed:
            return
        self.armed = False
        c = self._state_c
        if c.steps:
            if self._decoder is not None:  # (the stage's own step commits as it goes)
                self._cache.commit(c.position - self._start)
                self._state.mask = self._mask[:, :c.position].clone()
            self.order.last_id = c.next_id - 1
            self.session.last_used_s = time.monotonic()
        c.steps = 0
