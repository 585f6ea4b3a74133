"""kernels/frame.c: the compact frames and their keyed BLAKE2b MAC in C are byte for byte wire/compact.py's (hashlib's
BLAKE2b), and its open functions refuse what compact.py refuses."""
from __future__ import annotations

import ctypes
import hashlib
import os
import random

import numpy as np
import pytest

from swarmlm.kernels import available, frame_types, library
from swarmlm.kernels.frame_types import AnswerHead, FrameKey, StepHead
from swarmlm.wire import compact, frames
from swarmlm.wire.frames import Kind
from swarmlm.wire.session_keys import MAC_BYTES

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler")

OK, TAMPERED, LENGTH = 0, 1, 2


def _mac(key: bytes, sid: str, person: bytes, data: bytes) -> bytes:
    out = ctypes.create_string_buffer(16)
    buf = ctypes.create_string_buffer(data, len(data))
    library().frame_mac(FrameKey.of(key, sid), person, buf, len(data), out)
    return out.raw


@pytest.mark.parametrize("length", [0, 1, 110, 111, 112, 127, 128, 129, 255, 256, 257, 1000, 4096 + 37])
def test_the_mac_is_hashlibs_keyed_personalised_blake2b(length):
    rng = random.Random(length)
    for person in (b"swarmlm-step", b"swarmlm-answer", b"swarmlm-push", b"", b"0123456789abcdef"):
        key = bytes(rng.getrandbits(8) for _ in range(rng.choice([1, 16, 32, 64])))
        sid = "".join(rng.choice("0123456789abcdef") for _ in range(rng.choice([0, 1, 32])))
        data = os.urandom(length)
        want = hashlib.blake2b(sid.encode() + b"\n" + data, digest_size=16, key=key, person=person).digest()
        assert _mac(key, sid, person, data) == want


def test_a_step_frame_is_compacts_byte_for_byte_and_opens():
    key, sid = os.urandom(32), "a" * 32
    values = np.random.default_rng(0).standard_normal(3 * 1 * 576).astype(np.float32)
    want = compact.step_frame(key, sid, 41, 3, 1, 576, values)
    out = ctypes.create_string_buffer(len(want))
    k = FrameKey.of(key, sid)
    size = library().frame_step(k, StepHead(41, 3, 1, 576), values.ctypes.data, out)
    assert size == len(want) and out.raw == want
    body = want[frames.HEADER.size:]
    head = StepHead()
    assert library().frame_open_step(k, body, len(body), head) == OK
    assert (head.step_id, head.b, head.t, head.h) == (41, 3, 1, 576)
    assert compact.CompactStep(body).verified(key, sid)


def test_a_step_frame_refuses_dims_out_of_its_fields():
    k = FrameKey.of(b"k" * 32, "s")
    out = ctypes.create_string_buffer(64)
    for b, t, h in ((0, 1, 8), (1 << 16, 1, 8), (1, 0, 8), (1, 1, 0), (1, 1 << 32, 8)):
        assert library().frame_step(k, StepHead(1, b, t, h), None, out) == -1


def test_opening_a_step_refuses_a_changed_byte_a_short_body_and_a_wrong_length():
    key, sid = os.urandom(32), "s1"
    values = np.arange(8, dtype=np.float32)
    body = compact.step_frame(key, sid, 7, 1, 1, 8, values)[frames.HEADER.size:]
    k, head = FrameKey.of(key, sid), StepHead()
    for i in range(len(body)):
        changed = bytearray(body)
        changed[i] ^= 0x01
        assert library().frame_open_step(k, bytes(changed), len(changed), head) == TAMPERED
    assert library().frame_open_step(FrameKey.of(key, "s2"), body, len(body), head) == TAMPERED  # another session's
    assert library().frame_open_step(FrameKey.of(os.urandom(32), sid), body, len(body), head) == TAMPERED
    for size in range(0, 32):
        assert library().frame_open_step(k, body[:size], size, head) == TAMPERED
    # dims that do not match the values, MACed by the key's holder: a length error, not a tampered frame
    wrong = compact.step_frame(key, sid, 8, 1, 1, 9, values)[frames.HEADER.size:]
    assert library().frame_open_step(k, wrong, len(wrong), head) == LENGTH
    huge = compact.step_frame(key, sid, 9, 0xFFFF, 0xFFFF, 0xFFFFFFFF, b"")[frames.HEADER.size:]
    assert library().frame_open_step(k, huge, len(huge), head) == LENGTH  # (no overflow of b * t * h * 4)


def test_an_answer_frame_is_compacts_byte_for_byte_and_opens_as_compacts_answer():
    key, sid = os.urandom(32), "f" * 32
    values = np.random.default_rng(1).standard_normal(2 * 64).astype(np.float32)
    want = compact.answer_frame(key, sid, 12, 99, values, 0.001, 0.002, 0.003, 0.004, 2,
                                pushed_dims=(2, 1, 64))
    out = ctypes.create_string_buffer(len(want))
    k = FrameKey.of(key, sid)
    head = AnswerHead(12, 99, 2, compact.PUSHED, 0.001, 0.002, 0.003, 0.004)
    size = library().frame_answer(k, head, values.ctypes.data, values.size, out)
    assert size == len(want) and out.raw == bytes(want)
    body = bytes(want[frames.HEADER.size:])
    opened = AnswerHead()
    assert library().frame_open_answer(k, body, len(body), values.size, opened) == OK
    got = compact.Answer(body).opened(key, sid, values.size)
    assert (opened.step_id, opened.position, opened.batched, bool(opened.flags & compact.PUSHED)) == \
        (got.step_id, got.position, got.batched_steps, got.pushed)
    assert (opened.queued_s, opened.compute_s, opened.parse_s, opened.encode_s) == \
        (got.queued_s, got.compute_s, got.parse_s, got.encode_s)
    assert want[4] == Kind.ANSWER


def test_opening_an_answer_refuses_what_compact_refuses():
    key, sid = os.urandom(32), "s"
    values = np.ones(16, dtype=np.float32)
    body = bytes(compact.answer_frame(key, sid, 1, 1, values, 0, 0, 0, 0, 1)[frames.HEADER.size:])
    k, head = FrameKey.of(key, sid), AnswerHead()
    assert library().frame_open_answer(k, body, len(body), 15, head) == LENGTH
    with pytest.raises(Exception):
        compact.Answer(body).opened(key, sid, 15)
    for i in (0, 16, 49, len(body) - 1):
        changed = bytearray(body)
        changed[i] ^= 0x80
        assert library().frame_open_answer(k, bytes(changed), len(changed), 16, head) == TAMPERED
        with pytest.raises(compact.Tampered):
            compact.Answer(bytes(changed)).opened(key, sid, 16)
    for size in (0, 16, 48, 64):
        assert library().frame_open_answer(k, body[:size], size, 0, head) == TAMPERED
    # an ANSWER's MAC is not a STEP's: the personalisation separates them
    step = compact.step_frame(key, sid, 1, 1, 1, 16, values)[frames.HEADER.size:]
    assert library().frame_open_answer(k, step, len(step), 0, head) == TAMPERED


def test_the_frame_sizes_kernels_know_are_the_wires():
    assert (frame_types.FRAME_HEADER, frame_types.STEP_HEAD, frame_types.ANSWER_HEAD, frame_types.MAC) == \
        (frames.HEADER.size, compact.STEP_HEAD.size, compact.ANSWER_HEAD.size, MAC_BYTES)


def test_finiteness():
    lib = library()
    values = np.zeros(1000, dtype=np.float32)
    assert lib.frame_finite(values.ctypes.data, values.size) == 1
    for bad in (np.nan, np.inf, -np.inf):
        for where in (0, 517, 999):
            v = values.copy()
            v[where] = bad
            assert lib.frame_finite(v.ctypes.data, v.size) == 0
    big = np.full(7, np.finfo(np.float32).max, dtype=np.float32)
    assert lib.frame_finite(big.ctypes.data, big.size) == 1
    assert lib.frame_finite(None, 0) == 1


def _python_verdict_step(key: bytes, sid: str, body: bytes) -> int:
    step = compact.CompactStep(body)
    if not step.verified(key, sid):
        return TAMPERED
    try:
        step.values()
    except Exception:  # noqa: BLE001 (InvalidRequest: the length does not match the dims)
        return LENGTH
    return OK


def _python_verdict_answer(key: bytes, sid: str, body: bytes, count: int) -> int:
    try:
        compact.Answer(body).opened(key, sid, count)
    except compact.Tampered:
        return TAMPERED
    except Exception:  # noqa: BLE001 (InvalidRequest: the length is not the step's)
        return LENGTH
    return OK


def test_mutated_frames_get_the_python_twins_verdict():
    """A differential fuzz: valid STEP and ANSWER bodies cut, grown, bit-flipped, spliced, and re-MACed by the key's
    holder with dims that lie; C and Python must agree on every one (and C must not read past a body: the sanitizer
    of the CI's compiler is not assumed, but a wrong length verdict would show here)."""
    rng = random.Random(51)
    key, sid = os.urandom(32), "0123456789abcdef0123456789abcdef"
    lib, k = library(), FrameKey.of(key, sid)
    step_head, answer_head = StepHead(), AnswerHead()
    for case in range(400):
        n = rng.choice([1, 2, 7, 64])
        values = np.random.default_rng(case).standard_normal(n).astype(np.float32)
        step = compact.step_frame(key, sid, case, 1, 1, n, values)[frames.HEADER.size:]
        answer = bytes(compact.answer_frame(key, sid, case, case, values, 0.1, 0.2, 0.3, 0.4, 1)[frames.HEADER.size:])
        for body in (step, answer):
            how = rng.randrange(5)
            b = bytearray(body)
            if how == 0:
                b = b[:rng.randrange(len(b) + 1)]
            elif how == 1:
                b += os.urandom(rng.randrange(1, 40))
            elif how == 2:
                for _ in range(rng.randrange(1, 4)):
                    b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            elif how == 3:  # a holder of the key MACs dims that lie about the values
                lie = compact.step_frame(key, sid, case, rng.randrange(1, 4), rng.randrange(1, 3), rng.randrange(1, 80),
                                         values)
                b = bytearray(lie[frames.HEADER.size:])
            b = bytes(b)
            buf = ctypes.create_string_buffer(b, len(b))  # (exactly its bytes: no slack past the end)
            assert lib.frame_open_step(k, buf, len(b), step_head) == _python_verdict_step(key, sid, b)
            count = rng.choice([n, n - 1, n + 1, 0])
            assert lib.frame_open_answer(k, buf, len(b), count, answer_head) == \
                _python_verdict_answer(key, sid, b, count)


def test_a_step_frame_refuses_dims_whose_values_overflow_its_length():
    """4 * B * T * H past the body's u32 length (and past 64 bits: 4 * 2^16 * 2^16 * 2^32) is refused, not wrapped."""
    k = FrameKey.of(b"k" * 32, "s")
    out = ctypes.create_string_buffer(64)
    for b, t, h in ((0xFFFF, 0xFFFF, 0xFFFFFFFF), (1, 1, 1 << 30), (0xFFFF, 0xFFFF, 1 << 16)):
        assert library().frame_step(k, StepHead(1, b, t, h), None, out) == -1


def test_a_push_step_is_compact_pys_and_opens_only_for_its_session_secret_and_key():
    """frame_push_step writes wire/compact.py's push_frame byte for byte; frame_open_push_step takes it back (its
    header, where its values start) only for its session id and secret (else OTHER) under its push key (else
    TAMPERED), and a body of the wrong length for its dims is LENGTH."""
    lib = library()
    key, sid, secret = b"k" * 32, "ab" * 16, b"s" * 16
    values = np.random.default_rng(0).standard_normal((2, 1, 8), dtype=np.float32)
    want = compact.push_frame(key, sid, secret, 7, 2, 1, 8, values.tobytes())
    out = ctypes.create_string_buffer(frame_types.push_step_overhead(sid) + values.nbytes)
    size = lib.frame_push_step(FrameKey.of(key, sid), secret, StepHead(7, 2, 1, 8), values.ctypes.data, out)
    assert out.raw[:size] == want
    body = want[frames.HEADER.size:]

    def opened(k: bytes, s: str, sec: bytes, data: bytes = body) -> tuple[int, tuple, int]:
        head, at = StepHead(), ctypes.c_int64()
        code = lib.frame_open_push_step(FrameKey.of(k, s), sec, data, len(data), ctypes.byref(head), ctypes.byref(at))
        return code, (head.step_id, head.b, head.t, head.h), at.value

    code, dims, at = opened(key, sid, secret)
    assert code == frame_types.OPENED and dims == (7, 2, 1, 8) and body[at:at + values.nbytes] == values.tobytes()
    assert opened(key, sid, b"w" * 16)[0] == frame_types.OTHER
    assert opened(key, "cd" * 16, secret)[0] == frame_types.OTHER
    assert opened(b"q" * 32, sid, secret)[0] == frame_types.TAMPERED
    longer = compact.push_frame(key, sid, secret, 7, 2, 1, 8, values.tobytes() + b"\0" * 4)[frames.HEADER.size:]
    assert opened(key, sid, secret, longer)[0] == frame_types.LENGTH
