"""Bounded spin-then-block waits (wire/spin.py): the same events and timeouts as a plain wait, the thread back at its
scheduling class after a spin, nothing spun at spin_wait 0."""
from __future__ import annotations

import os
import selectors
import socket
import threading
import time

import pytest

from swarmlm.client.frame_call import FrameCall
from swarmlm.config import SPIN_WAIT_S, ClientConfig, ServerConfig
from swarmlm.wire import spin
from swarmlm.wire.spin import GAP_FACTOR, SpinningSelector, SpinWindow

needs_spin = pytest.mark.skipif(not spin.can_spin(), reason="this process may not spin (no kernels, or SCHED_IDLE "
                                                             "could not be left)")


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def _open_window() -> SpinWindow:
    window = SpinWindow(60.0)
    window.note(time.monotonic())  # open for the test's length (a session's first step: the cap)
    return window


@needs_spin
def test_spinning_selector_gives_the_epoll_selectors_events(pair):
    a, b = pair
    plain, spinning = selectors.EpollSelector(), SpinningSelector(_open_window())
    for sel in (plain, spinning):
        sel.register(a, selectors.EVENT_READ | selectors.EVENT_WRITE, "a")
        sel.register(b, selectors.EVENT_READ, "b")
    a.send(b"x")
    for timeout in (None, 0, 0.5):
        want = sorted((key.data, ev) for key, ev in plain.select(timeout))
        assert sorted((key.data, ev) for key, ev in spinning.select(timeout)) == want
        assert ("b", selectors.EVENT_READ) in want and ("a", selectors.EVENT_WRITE) in want
    plain.close()
    spinning.close()


@needs_spin
def test_spinning_selector_honours_its_timeout_and_wakes_for_late_events(pair):
    a, b = pair
    sel = SpinningSelector(_open_window())
    sel.register(a, selectors.EVENT_READ, "a")
    assert sel.select(0.05) == []  # nothing came: the timeout ends the wait (spun, then blocked for the rest)
    timer = threading.Timer(0.05, b.send, (b"x",))
    timer.start()
    assert [(key.data, ev) for key, ev in sel.select(None)] == [("a", selectors.EVENT_READ)]  # woken while spinning
    timer.join()
    sel.close()


@needs_spin
def test_a_spin_runs_at_sched_idle_and_the_thread_returns_to_sched_other(pair):
    a, b = pair
    seen = {}

    def waiter() -> None:
        seen["ready"] = spin.spin_poll([(a.fileno(), select_pollin())], 30.0)
        seen["after"] = os.sched_getscheduler(0)

    thread = threading.Thread(target=waiter)
    thread.start()
    while True:  # (the spin lasts until the byte below: its policy is read from outside meanwhile)
        try:
            policy = os.sched_getscheduler(thread.native_id)
        except OSError:
            continue
        if policy == os.SCHED_IDLE:
            break
    b.send(b"x")
    thread.join()
    assert seen == {"ready": True, "after": os.SCHED_OTHER}
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


def select_pollin() -> int:
    import select

    return select.POLLIN


def test_spin_window_follows_the_gap_between_steps_and_is_capped():
    window = SpinWindow(0.2)
    assert window.budget(0.0) == 0.0  # nothing came yet: no spin
    window.note(10.0)  # a session's first step after a long quiet: the cap
    assert window.budget(10.0) == pytest.approx(0.2)
    window.note(10.01)  # steps 10 ms apart: GAP_FACTOR x 10 ms
    assert window.budget(10.01) == pytest.approx(GAP_FACTOR * 0.01)
    assert window.budget(10.01 + GAP_FACTOR * 0.01 + 1e-6) == 0.0  # the session stopped: the loop sleeps again
    window.note(10.15)  # a slower step: the longest recent gap, still at most the cap
    assert window.budget(10.15) == pytest.approx(min(0.2, GAP_FACTOR * 0.14))


def test_spin_wait_zero_spins_nothing(pair, monkeypatch):
    window = SpinWindow(0.0)
    window.note(1.0)
    assert window.budget(1.0) == 0.0
    calls = []
    monkeypatch.setattr(spin, "_spin_poll", lambda: lambda *args: calls.append(args) or 1)
    a, b = pair
    a.setblocking(False)
    b.send(b"x")
    sel = SpinningSelector(window)
    sel.register(a, selectors.EVENT_READ, "a")
    assert [key.data for key, _ in sel.select(1.0)] == ["a"]
    call = FrameCall(a, 1 << 20, spin_wait_s=0.0)
    call._wait(select_pollin(), 1.0)
    assert FrameCall.wait_last([call], 1.0)
    assert calls == []  # neither the loop's nor the client's waits spun
    FrameCall(a, 1 << 20, spin_wait_s=0.01)._wait(select_pollin(), 1.0)
    assert len(calls) == 1  # (the same wait with a budget does)
    sel.close()


def test_spin_wait_is_configured_and_checked():
    assert ClientConfig().spin_wait_s == ServerConfig(model_dir="m", blocks=None).spin_wait_s == SPIN_WAIT_S  # one default
    assert ClientConfig(spin_wait_s=0.2).spin_wait_s == 0.2
    with pytest.raises(ValueError, match="spin_wait_s"):
        ClientConfig(spin_wait_s=-1)
    with pytest.raises(ValueError, match="spin_wait_s"):
        ServerConfig(model_dir="m", blocks=None, spin_wait_s=-0.001)
