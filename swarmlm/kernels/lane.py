"""What a server's one-call decode step (kernels/lane.c `lane_decode_answer`) takes besides the decoder's arrays:
frame.h's session key and ANSWER header as ctypes structures, and the code for a refused value."""
from __future__ import annotations

import ctypes

NOT_FINITE = -100  # lane.c LANE_NOT_FINITE: a value is NaN or infinite (nothing computed)
FRAME_HEADER, ANSWER_HEAD, MAC = 5, 49, 16  # frame.h FRAME_HEADER, FRAME_ANSWER_HEAD, FRAME_MAC
ANSWER_OVERHEAD = FRAME_HEADER + ANSWER_HEAD + MAC  # an ANSWER frame's bytes besides its values


class FrameKey(ctypes.Structure):
    """frame.h `struct frame_key`: a session's MAC key and id. Keeps the bytes it points into alive."""

    _fields_ = [("key", ctypes.c_char_p), ("key_len", ctypes.c_int64), ("sid", ctypes.c_char_p),
                ("sid_len", ctypes.c_int64)]

    @classmethod
    def of(cls, key: bytes, session_id: str) -> "FrameKey":
        sid = session_id.encode("ascii")
        made = cls(key, len(key), sid, len(sid))
        made._held = (key, sid)  # (c_char_p fields point into these)
        return made


class AnswerHead(ctypes.Structure):
    """frame.h `struct frame_answer_head`: step id, position, batched steps, flags, queued / compute / parse /
    encode seconds."""

    _fields_ = [("step_id", ctypes.c_uint64), ("position", ctypes.c_int64), ("batched", ctypes.c_int64),
                ("flags", ctypes.c_int64), ("queued_s", ctypes.c_double), ("compute_s", ctypes.c_double),
                ("parse_s", ctypes.c_double), ("encode_s", ctypes.c_double)]
