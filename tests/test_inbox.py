"""A session's inbox (server/inbox.py): asyncio.Queue's behaviour for what a session's stream needs, a bounded FIFO
with one reader, its wait bounded by the idle timeout."""
from __future__ import annotations

import asyncio

import pytest

from swarmlm.server.inbox import Inbox


def test_items_come_out_in_order_and_a_full_inbox_refuses_put_nowait():
    async def run() -> list:
        inbox = Inbox(2)
        inbox.put_nowait("a")
        inbox.put_nowait("b")
        assert inbox.full()
        with pytest.raises(asyncio.QueueFull):
            inbox.put_nowait("c")
        return [await inbox.get(1.0), await inbox.get(1.0)]

    assert asyncio.run(run()) == ["a", "b"]


def test_a_get_waits_for_a_put_and_times_out_without_one():
    async def run() -> tuple:
        inbox = Inbox(1)
        getting = asyncio.ensure_future(inbox.get(5.0))
        await asyncio.sleep(0.01)
        waited = not getting.done()
        inbox.put_nowait("x")
        got = await getting
        with pytest.raises(TimeoutError):
            await inbox.get(0.05)
        inbox.put_nowait("y")  # (the timed-out wait left nothing behind)
        return waited, got, await inbox.get(1.0)

    assert asyncio.run(run()) == (True, "x", "y")


def test_puts_wait_for_room_in_order_and_a_cancelled_one_passes_its_room_on():
    async def run() -> list:
        inbox = Inbox(1)
        inbox.put_nowait(0)
        first, second, third = (asyncio.ensure_future(inbox.put(i)) for i in (1, 2, 3))
        await asyncio.sleep(0.01)
        assert not any(p.done() for p in (first, second, third))
        got = [await inbox.get(1.0)]  # room for one: the first put's
        first.cancel()  # given the room, then cancelled before it ran: the second takes the room
        await asyncio.sleep(0.01)
        got.append(await inbox.get(1.0))
        got.append(await inbox.get(1.0))
        await asyncio.gather(second, third)
        with pytest.raises(asyncio.CancelledError):
            await first
        return got

    assert asyncio.run(run()) == [0, 2, 3]


def test_a_cancelled_get_leaves_the_inbox_usable():
    async def run() -> str:
        inbox = Inbox(1)
        getting = asyncio.ensure_future(inbox.get(5.0))
        await asyncio.sleep(0.01)
        getting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await getting
        inbox.put_nowait("z")
        return await inbox.get(1.0)

    assert asyncio.run(run()) == "z"
