"""One LM head for the concurrent sessions of one client process.

A client process often runs many sessions at once (threads each calling `generate()`, the API gateway's streams).
Each step ends in the final norm + LM head, which at a 250k vocabulary reads a 1 GB matrix (fp32) per call: memory
bound, so 8 rows cost about as much as one. Alone, each session's head would run on its own thread and they would
share the CPU 8 ways; and because they finish one after another, their next steps reach the servers spread out
and the servers cannot batch them either. Here the head calls that are in flight together run as ONE matmul.

How calls meet: the first caller of a forming batch (the leader) waits until every session that took part in
one of the last two batches, or was announced (`expect`, when it opens) and has not called yet, and is still
open, has arrived, at most `wait.fraction` x the last batch's head time
(and `wait.max_s`: ClientConfig.head_batch_wait, config.StragglerWait, the rule the server's rounds wait by too); then it computes the whole batch and hands each caller its rows. A lone session never waits:
nobody else is expected. A session that stops calling drops out of the expected set after two batches.

Why wait as long as a whole head: sessions that fell apart (into two groups, one at the head while the other is
at the servers) would otherwise stay apart for good, and two heads of 4 rows cost the CPU about twice one head of 8.
Waiting at most one head's time for the other group merges them in one step (measured: 8 threads' `generate()`
settled into two alternating groups of 4 with a wait bounded by a tenth of the head time). Once together, sessions
come back within milliseconds of each other (the servers batch their steps too) and the wait is that short.

The head is row-wise (a norm over the hidden size, then a linear map), so each caller gets what it would get
alone, up to the float rounding of a wider matmul.
"""
from __future__ import annotations

import threading
import time
import weakref
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable

import torch

from swarmlm.config import StragglerWait

POLL_S = 0.005  # how often a waiting leader checks whether the sessions it waits for were closed

@dataclass(eq=False)
class _Call:
    key: int  # id of the caller's session
    hidden: torch.Tensor  # [..., H]
    result: torch.Tensor | None = None
    error: BaseException | None = None
    done: bool = False


class HeadBatcher:
    """`batcher(session, hidden)` == `head(hidden)`, computed together with other sessions' concurrent calls.

    head: rows [N, H] -> [N, V], row-wise. session: any object with a `closed` attribute (an InferenceSession):
    closed sessions are never waited for."""

    def __init__(self, head: Callable[[torch.Tensor], torch.Tensor], wait: StragglerWait) -> None:
        self.head = head
        self.wait = wait  # ClientConfig.head_batch_wait
        self._cv = threading.Condition()
        self._pending: list[_Call] = []  # the forming batch, arrival order; its first call leads it
        self._sessions: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()
        self._recent: deque[set[int]] = deque(maxlen=2)  # sessions of the last two batches
        self._announced: dict[int, int] = {}  # opened, not called yet -> batches left to wait for them
        self._last_s = 0.0  # the last batch's head time
        self.batch_sizes: Counter[int] = Counter()  # sessions per computed batch -> batches (diagnostics)

    def expect(self, session: object) -> None:
        """A session opened and will call soon: batches wait for its first call too (for the next two batches at
        most: a session that never calls the head is then forgotten). So sessions started together (their prefills
        of different lengths end at different times) share heads from their first token on."""
        with self._cv:
            self._sessions[id(session)] = session
            self._announced[id(session)] = 2

    def __call__(self, session: object, hidden: torch.Tensor) -> torch.Tensor:
        call = _Call(id(session), hidden)
        with self._cv:
            self._sessions[call.key] = session
            self._announced.pop(call.key, None)
            self._pending.append(call)
            self._cv.notify_all()  # a waiting leader may have everyone now
            arrived, last_s = time.perf_counter(), self._last_s
            while not call.done:
                leading = self._pending and self._pending[0] is call
                left = self.wait.left_s(self._missing(), last_s, time.perf_counter() - arrived) if leading else 0.0
                if leading and left <= 0:
                    batch, self._pending = self._pending, []
                    break
                # a leader looks again every few ms: a session it waits for may close without calling
                self._cv.wait(min(left, POLL_S) if leading else None)
            else:
                return self._result(call)
        self._compute(batch)  # outside the lock: the next batch forms meanwhile
        with self._cv:
            self._recent.append({c.key for c in batch})
            self._announced = {key: left - 1 for key, left in self._announced.items() if left > 1}
            self.batch_sizes[len(batch)] += 1
            self._cv.notify_all()
        return self._result(call)

    def _missing(self) -> int:
        """(Holding the lock, as a leader.) Sessions expected in this batch, still open, that have not called."""
        here = {c.key for c in self._pending}
        expected = set().union(*self._recent, self._announced) - here
        return sum(1 for key in expected
                   if (s := self._sessions.get(key)) is not None and not getattr(s, "closed", False))

    def _compute(self, batch: list[_Call]) -> None:
        t0 = time.perf_counter()
        try:
            if len(batch) == 1:
                outs = [self.head(batch[0].hidden)]
            else:
                width = batch[0].hidden.shape[-1]
                rows = torch.cat([c.hidden.reshape(-1, width) for c in batch])
                flat = self.head(rows)
                sizes = [c.hidden[..., 0].numel() for c in batch]
                outs = [o.reshape(*c.hidden.shape[:-1], o.shape[-1]) for c, o in zip(batch, flat.split(sizes))]
            for c, o in zip(batch, outs):
                c.result = o
        except BaseException as exc:  # every caller of the batch sees the error
            for c in batch:
                c.error = exc
        self._last_s = time.perf_counter() - t0
        for c in batch:
            c.done = True

    @staticmethod
    def _result(call: _Call) -> torch.Tensor:
        if call.error is not None:
            raise call.error
        return call.result
