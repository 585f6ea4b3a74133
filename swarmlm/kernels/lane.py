"""The ctypes side of kernels/lane.c (a server's plain decode step of a packed span answered in one call): its
function's signature, declared on the loaded library by `declare`, and what it returns besides a frame's size. Its
session key and ANSWER header are kernels/frame_types.py's structs."""
from __future__ import annotations

import ctypes

from swarmlm.kernels.frame_types import AnswerHead, FrameKey

NOT_FINITE = -100  # lane.c LANE_NOT_FINITE: a value is NaN or infinite (nothing computed)


def declare(lib: ctypes.CDLL) -> None:
    """lane.c's function on `lib` (the kernels' build): decode_span's arguments (the dims, blocks and block count, the
    hidden size, then the STEP's body and where its values start, the work rows, and decode_span's per-row arrays and
    rotary table), the session's key, the ANSWER's header and where the frame goes."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.lane_decode_answer.argtypes = [ptr, ptr, i64, i64, ctypes.c_char_p, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr,
                                       ptr, ptr, i64, i64, ctypes.POINTER(FrameKey), ctypes.POINTER(AnswerHead), ptr]
    lib.lane_decode_answer.restype = i64
    # the step lane's (server/lane.py): its state (`struct lane`), a read's bytes, where the ANSWER goes
    lib.lane_take.argtypes = [ptr, ctypes.c_char_p, i64, ptr]
    lib.lane_take.restype = i64
    lib.lane_open.argtypes = [ptr, ctypes.c_char_p, i64, ptr]
    lib.lane_open.restype = ctypes.c_int
    lib.lane_answer.argtypes = [ptr, ptr, ctypes.c_double, ctypes.c_double, ptr]
    lib.lane_answer.restype = i64
