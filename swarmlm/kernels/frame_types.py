"""The ctypes side of kernels/frame.h (compact frames in C): its structs, and the functions' signatures, declared on
the loaded library by `declare`."""
from __future__ import annotations

import ctypes

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
# frame.h's sizes (FRAME_HEADER, FRAME_STEP_HEAD, FRAME_ANSWER_HEAD, FRAME_MAC): wire/frames.py's and wire/compact.py's
# struct sizes, which tests/test_frame_c.py holds them to (kernels sit below wire: they cannot import them)
FRAME_HEADER, STEP_HEAD, ANSWER_HEAD, MAC, SECRET = 5, 16, 49, 16, 16
ANSWER_OVERHEAD = FRAME_HEADER + ANSWER_HEAD + MAC  # an ANSWER frame's bytes besides its values
# frame.h's FRAME_OK, FRAME_TAMPERED, FRAME_LENGTH, FRAME_OTHER (what frame_open_* return)
OPENED, TAMPERED, LENGTH, OTHER = 0, 1, 2, 3


def push_step_overhead(session_id: str) -> int:
    """A PUSH_STEP frame's bytes into that session besides its values (wire/compact.py push_frame)."""
    return FRAME_HEADER + 1 + len(session_id) + SECRET + STEP_HEAD + MAC


class FrameKey(ctypes.Structure):
    """A session's MAC context: its key and its id (ASCII), as bytes the struct points into (kept alive with it)."""

    _fields_ = [("key", _ptr), ("key_len", _i64), ("sid", _ptr), ("sid_len", _i64)]

    @classmethod
    def of(cls, key: bytes, session_id: str) -> "FrameKey":
        sid = session_id.encode("ascii")
        made = cls(ctypes.cast(ctypes.c_char_p(key), _ptr), len(key), ctypes.cast(ctypes.c_char_p(sid), _ptr),
                   len(sid))
        made._held = (key, sid)  # the bytes the pointers read
        return made


class StepHead(ctypes.Structure):
    _fields_ = [("step_id", ctypes.c_uint64), ("b", _i64), ("t", _i64), ("h", _i64)]


class AnswerHead(ctypes.Structure):
    _fields_ = [("step_id", ctypes.c_uint64), ("position", _i64), ("batched", _i64), ("flags", _i64),
                ("queued_s", ctypes.c_double), ("compute_s", ctypes.c_double), ("parse_s", ctypes.c_double),
                ("encode_s", ctypes.c_double)]


def declare(lib: ctypes.CDLL) -> None:
    """frame.h's functions on `lib` (the kernels' build)."""
    key, step, answer = ctypes.POINTER(FrameKey), ctypes.POINTER(StepHead), ctypes.POINTER(AnswerHead)
    lib.frame_mac.argtypes = [key, ctypes.c_char_p, _ptr, _i64, _ptr]
    lib.frame_mac.restype = None
    lib.frame_step.argtypes = [key, step, _ptr, _ptr]
    lib.frame_step.restype = _i64
    lib.frame_open_step.argtypes = [key, _ptr, _i64, step]
    lib.frame_open_step.restype = ctypes.c_int
    lib.frame_answer.argtypes = [key, answer, _ptr, _i64, _ptr]
    lib.frame_answer.restype = _i64
    lib.frame_open_answer.argtypes = [key, _ptr, _i64, _i64, answer]
    lib.frame_open_answer.restype = ctypes.c_int
    lib.frame_finite.argtypes = [_ptr, _i64]
    lib.frame_finite.restype = ctypes.c_int
    lib.frame_push_step.argtypes = [key, _ptr, step, _ptr, _ptr]
    lib.frame_push_step.restype = _i64
    lib.frame_open_push_step.argtypes = [key, _ptr, _ptr, _i64, step, ctypes.POINTER(_i64)]
    lib.frame_open_push_step.restype = ctypes.c_int
