"""The ctypes side of kernels/lane.c (a server's plain decode step of a packed span answered in one call): its
function's signature, declared on the loaded library by `declare`, and what it returns besides a frame's size. Its
session key and ANSWER header are kernels/frame_types.py's structs."""
from __future__ import annotations

import ctypes

from swarmlm.kernels.frame_types import AnswerHead, FrameKey

NOT_FINITE = -100  # lane.c LANE_NOT_FINITE: a value is NaN or infinite (nothing computed)
# why the lane's thread stopped (lane.c's LANE_*): the loop disarmed it; bytes not its STEP; the peer's end or a
# failure; an ANSWER not wholly sent; (lane_next) its STEP, checked, to compute
STOPPED, DECLINED, ENDED, UNSENT, FRAME = 1, 2, 3, 4, 5


class LaneIO(ctypes.Structure):
    """lane.c's `struct lane_io`: the socket the lane's thread reads (and writes ANSWERs to, unless `answer_fd`
    is another: a lane that reads pushes), the descriptor that stops it, how long a begun frame may take, the push
    connection it pushes on (-1: none); after a stop, what it read and did not take, and what it did not send."""

    _fields_ = [("fd", ctypes.c_int64), ("wake_fd", ctypes.c_int64), ("stall_s", ctypes.c_double),
                ("got", ctypes.c_int64), ("sent", ctypes.c_int64), ("size", ctypes.c_int64), ("err", ctypes.c_int64),
                ("answer_fd", ctypes.c_int64), ("push_fd", ctypes.c_int64), ("push_sent", ctypes.c_int64),
                ("push_size", ctypes.c_int64)]


def declare(lib: ctypes.CDLL) -> None:
    """lane.c's function on `lib` (the kernels' build): decode_span's arguments (the dims, blocks and block count, the
    hidden size, then the STEP's body and where its values start, the work rows, and decode_span's per-row arrays and
    rotary table), the session's key, the ANSWER's header and where the frame goes."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.lane_decode_answer.argtypes = [ptr, ptr, i64, i64, ctypes.c_char_p, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr,
                                       ptr, ptr, i64, i64, ctypes.POINTER(FrameKey), ctypes.POINTER(AnswerHead), ptr]
    lib.lane_decode_answer.restype = i64
    # the step lane's thread (server/lane.py): its state (`struct lane`), its LaneIO, the read buffer, (lane_next) the
    # STEP's head, (lane_serve, lane_reply) the ANSWER's buffer
    lib.lane_serve.argtypes = [ptr, ptr, ptr, ptr]
    lib.lane_serve.restype = i64
    lib.lane_next.argtypes = [ptr, ptr, ptr, ptr]
    lib.lane_next.restype = i64
    lib.lane_reply.argtypes = [ptr, ptr, ptr, ctypes.c_double, ctypes.c_double, ptr]
    lib.lane_reply.restype = i64
