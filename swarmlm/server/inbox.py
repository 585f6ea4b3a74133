"""A session's inbox: its steps (from its stream and from pushes) waiting for the stream's task
(server/session_stream.py). asyncio.Queue's behaviour for what the session needs (a bounded FIFO; `put_nowait` raises
asyncio.QueueFull, `put` waits for room, `get` for an item; one reader) in fewer calls: every decode step passes
through it right after a forward, when each Python call costs ~10x its warm time (docs/RESULTS-hop.md round 11),
and asyncio.Queue made ~15 of them per step (full, qsize, _put, _wakeup_next, empty, get_nowait, _get, ...) plus
an asyncio.timeout around the wait (~7 more); this makes 2-3."""
from __future__ import annotations

import asyncio
from collections import deque
from typing import Any


class Inbox:
    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._items: deque = deque()
        self._reader: asyncio.Future | None = None  # the reader's, while it waits for an item
        self._room: deque[asyncio.Future] = deque()  # puts waiting for room, oldest first

    def empty(self) -> bool:
        return not self._items

    def full(self) -> bool:
        return len(self._items) >= self.maxsize

    def put_nowait(self, item: Any) -> None:
        if len(self._items) >= self.maxsize:
            raise asyncio.QueueFull
        self._items.append(item)
        reader = self._reader
        if reader is not None and not reader.done():
            reader.set_result(None)

    async def put(self, item: Any) -> None:
        """Put `item` once there is room (puts that wait get it in order)."""
        while len(self._items) >= self.maxsize:
            room = asyncio.get_running_loop().create_future()
            self._room.append(room)
            try:
                await room
            except BaseException:
                room.cancel()
                if room in self._room:
                    self._room.remove(room)
                elif not room.cancelled() and len(self._items) < self.maxsize:
                    self._wake_a_put()  # it was given the room, then cancelled: the next waiting put takes it
                raise
        self.put_nowait(item)

    async def get(self, timeout_s: float) -> Any:
        """The oldest item; TimeoutError if none comes within `timeout_s`. (One reader at a time.)"""
        while not self._items:
            loop = asyncio.get_running_loop()
            reader = self._reader = loop.create_future()
            timer = loop.call_later(timeout_s, _time_out, reader)
            try:
                await reader
            finally:
                timer.cancel()
                self._reader = None
        item = self._items.popleft()
        if self._room:
            self._wake_a_put()
        return item

    def _wake_a_put(self) -> None:
        while self._room:
            room = self._room.popleft()
            if not room.done():
                room.set_result(None)
                return


def _time_out(reader: asyncio.Future) -> None:
    if not reader.done():
        reader.set_exception(TimeoutError())
