"""kernels/frame.c: the compact frames and their keyed BLAKE2b MAC in C are byte for byte wire/compact.py's (hashlib's
BLAKE2b), and its open functions refuse what compact.py refuses."""
from __future__ import annotations

import ctypes
import hashlib
import os
import random

import numpy as np
import pytest

from swarmlm.kernels import available, library
from swarmlm.kernels.frame_types import AnswerHead, FrameKey, StepHead
from swarmlm.wire import compact, frames
from swarmlm.wire.frames import Kind

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
