"""The queue of compute work from all sessions, run one job at a time on a dedicated thread.

Jobs carry a priority (lower runs first; ties in arrival order): decode steps go ahead of prefills so one long
prompt cannot stall everyone's next token. Every job reports how long it waited and how long it ran.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import torch

DECODE, PREFILL = 0, 1  # priorities


@dataclass(frozen=True)
class JobTiming:
    queued_s: float
    compute_s: float


class Scheduler:
    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._heap: list[tuple[int, int, float, Callable[[], Any], Future]] = []
        self._counter = itertools.count()
        self._cv = threading.Condition()
        self._stopped = False
        self._worker = threading.Thread(target=self._run, name="swarmlm-compute", daemon=True)
        self._worker.start()

    @property
    def queue_length(self) -> int:
        return len(self._heap)

    async def submit(self, fn: Callable[[], Any], priority: int = DECODE) -> tuple[Any, JobTiming]:
        future: Future = Future()
        with self._cv:
            if self._stopped:
                raise RuntimeError("scheduler is stopped")
            heapq.heappush(self._heap, (priority, next(self._counter), time.perf_counter(), fn, future))
            self._cv.notify()
        return await asyncio.wrap_future(future)

    def _run(self) -> None:
        torch.set_num_threads(self.threads)  # this thread does all compute: set its threads explicitly
        while True:
            with self._cv:
                while not self._heap and not self._stopped:
                    self._cv.wait()
                if self._stopped and not self._heap:
                    return
                _, _, enqueued, fn, future = heapq.heappop(self._heap)
            if not future.set_running_or_notify_cancel():
                continue
            started = time.perf_counter()
            try:
                result = fn()
            except BaseException as exc:  # the caller decides; the worker keeps serving
                future.set_exception(exc)
                continue
            future.set_result((result, JobTiming(started - enqueued, time.perf_counter() - started)))

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._worker.join(timeout=10)
