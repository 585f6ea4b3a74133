"""The queue of compute work from all sessions, run in rounds on one dedicated thread (continuous batching).

Whenever the thread is free it plans a round from everything queued (`plan_round`), within a token budget
(`max_batch_tokens`, counting rows x new tokens):
1. decode steps (one new token) in arrival order; steps with equal batch keys (same sub-range, same token count)
   run as ONE batched forward;
2. then prefill work in arrival order while it fits in what is left of the budget; equal-shaped prefill chunks of
   different sessions batch too. The oldest prefill that does not fit is passed over at most `max_prefill_skips`
   rounds, then runs anyway: a steady stream of decodes cannot starve it, and a prompt larger than the whole
   budget still runs.
A round runs its decode batches before its prefills, so a long prompt delays everyone's next token by at most one
round. Steps that arrive while a round computes form the next round.

Sessions in lockstep reach a free server one by one: the first would run alone while the others, a client round
trip behind, form the round after (4 sessions settle into rounds of 1 and 3, and on CPU a 3-row forward costs
nearly 3 one-row ones; 2 sessions alternate alone forever). So before a round, the worker waits briefly for the
sessions of the last two decode rounds that are not back yet (`SchedulerConfig.batch_wait`, config.StragglerWait: at
most a fraction of the longer of the last two decode forwards' times, and at most `max_s`). A lone session never
waits; when waits stop gathering anyone (e.g. sessions come back over slow links), they stop, and are retried now
and then. Whether to wait is `StragglerGate`'s decision (pure, tested without a clock).

A forward's results reach their callers' event loops in ONE wake-up per loop (`_deliver`), not one per job: each
wake-up of another thread's loop is a write to its self-pipe, and on this VM (2 vCPUs, KVM) the compute thread spent
~7 % of its busy time in those writes with 8 sessions in rounds of 3-5 (py-spy, docs/RESULTS-packed.md "Round 11").

Every job reports how long it waited and how long it ran; a job computed in a batch reports the batch's forward
time (the members shared it) and the batch size.

A lone session's decode step runs on the caller's thread (the server's event loop) instead: when nothing is queued
or running, the last two decode rounds held only that session, and its last forward took at most
`inline_decode_max_s`. That saves the two thread hand-offs (loop -> compute thread -> loop) a hop otherwise pays,
~0.3-0.5 ms after the idle wait every server of a chain has between its turns (docs/RESULTS-perf.md), while the
loop is never blocked longer than one short forward; a second session's step, arriving meanwhile, is read after it
and from then on both go to the compute thread and batch.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Coroutine, Hashable

import torch

from swarmlm.config import SchedulerConfig, StragglerWait
from swarmlm.server.stage import SpanState, Stage, StepRequest
from swarmlm.types import CacheOp, StepKind

DECODE, PREFILL = StepKind.DECODE, StepKind.PREFILL  # priorities: decode steps first (one spelling: StepKind)
# after 4 waits for stragglers that gathered nobody, this many waits are skipped before one is tried again. Short:
# sessions that arrive spread out at first (e.g. 8 client threads whose LM heads finish one after another) come
# into step a few tokens later (the client batches their heads), and a wait that gathers them pays from then on;
# 32 kept the waits off for a whole short generation (8 sessions x 8 tokens: rounds of 7 + 1 throughout)
RETRY_WAIT_AFTER = 8


@dataclass
class StragglerGate:
    """Whether a round about to start waits for stragglers, and whether that wait paid: the whole policy, pure (no
    clock, no lock, no thread); the scheduler tells it what it sees and waits as long as `wait.left_s` says."""

    wait: StragglerWait  # SchedulerConfig.batch_wait
    fruitless: int = 0  # consecutive waits that gathered nobody
    skipped: int = 0  # waits skipped since the last try

    def may_open(self, expected: set[Hashable]) -> bool:
        """Can a wait start at all with these `expected` members? (Not for a lone session, or when waits are off;
        asked before the scheduler gathers what `opens` needs.)"""
        return self.wait.fraction != 0 and len(expected) >= 2

    def opens(self, expected: set[Hashable], queued: set[Hashable], decode_queued: bool) -> bool:
        """Does a wait start now? `expected`: the members of the last two decode rounds; `queued`: the members with
        a step queued. A lone session, prefill-only work or nobody missing: no wait; after 4 fruitless waits, the
        next RETRY_WAIT_AFTER are skipped."""
        if not self.may_open(expected) or not decode_queued or expected <= queued:
            return False
        if self.fruitless >= 4 and self.skipped < RETRY_WAIT_AFTER:
            self.skipped += 1  # waits have not paid lately
            return False
        self.skipped = 0
        return True

    def ended(self, missing_before: int, missing_after: int) -> None:
        """A wait ended with `missing_after` of the `missing_before` expected members still missing."""
        self.fruitless = 0 if missing_after < missing_before else self.fruitless + 1


@dataclass(frozen=True)
class JobTiming:
    queued_s: float  # from submission to the start of the forward that ran the job
    compute_s: float  # that forward's time; for a batch, the whole batch's (the same for every member)
    batched_steps: int = 1  # jobs computed by that forward (of all sessions)


@dataclass(frozen=True)
class Batchable:
    """Work that may share a forward with other items of the same key: `run_batch(items)` returns their results
    in order."""

    run_batch: Callable[[list[Any]], list[Any]]
    key: Hashable  # items batch together only with equal keys (and equal run_batch)
    item: Any
    member: Hashable  # who the item belongs to: one item per member per round (a session's steps are ordered)


@dataclass(eq=False)
class Job:
    priority: StepKind  # DECODE or PREFILL
    batch_tokens: int  # rows x new tokens: the job's share of a round's budget (max_batch_tokens)
    enqueued_s: float
    work: Batchable
    skipped: int = 0  # rounds this job was passed over as the oldest prefill
    # the caller's future on its event loop (None for a step run on the caller's thread): its outcome, given by
    # `_deliver`; a caller that gives up before a round takes the job takes it out of the queue (never run)
    waiter: asyncio.Future | None = None
    # what the worker's forward gave (written on the worker, read on the caller's loop after `_deliver`; plain
    # fields rather than a concurrent Future: each of its calls takes a lock, ~15 calls per step, all cold)
    outcome: Any = None  # (result, JobTiming)
    error: BaseException | None = None  # what the forward raised instead
    # the work's, kept as fields (read several times per round: properties would be a Python call each time)
    group_key: Hashable = field(init=False)  # jobs of equal keys (and run_batch) share a forward
    member: Hashable = field(init=False)

    def __post_init__(self) -> None:
        self.group_key = (self.work.run_batch, self.work.key)
        self.member = self.work.member


def plan_round(queue: list[Job], max_tokens: int, max_prefill_skips: int) -> list[list[Job]]:
    """Choose the next round's jobs from `queue` (arrival order) as groups to run in order, one forward each.

    Decodes first, then prefills, all within `max_tokens` (a round always takes at least one job). Updates the
    oldest prefill's `skipped` count when it is passed over. Does not remove anything from `queue`."""
    groups: dict[Hashable, list[Job]] = {}
    members: set[Hashable] = set()
    used = 0

    def take(job: Job) -> None:
        nonlocal used
        groups.setdefault(job.group_key, []).append(job)
        members.add(job.member)
        used += job.batch_tokens

    for job in queue:
        if job.priority != DECODE or job.member in members:
            continue
        if used and used + job.batch_tokens > max_tokens:
            break  # in arrival order: a later, smaller decode does not overtake this one
        take(job)
    oldest = True
    for job in queue:
        if job.priority != PREFILL or job.member in members:
            continue
        if used == 0 or used + job.batch_tokens <= max_tokens:
            take(job)
        elif oldest and job.skipped >= max_prefill_skips:
            take(job)  # waited long enough: runs even though the round goes over budget
            break
        else:
            if oldest:
                job.skipped += 1
            break  # prefills keep arrival order: none overtakes the one that did not fit
        oldest = False
    return list(groups.values())


def _resolve_waiters(jobs: list[Job]) -> None:
    """(On the callers' loop.) Each run job's outcome to its `waiter`."""
    for job in jobs:
        if job.waiter.done():  # the caller gave up after a round took its job (it ran anyway)
            continue
        if job.error is None:
            job.waiter.set_result(job.outcome)
        else:
            job.waiter.set_exception(job.error)


class Scheduler:
    def __init__(self, threads: int, config: SchedulerConfig = SchedulerConfig()) -> None:
        self.threads = threads
        self.config = config
        self.inline_runs = 0  # lone decode steps run on the caller's thread (see the module's docstring)
        # the armed step lane (server/lane.py), whose thread computes while the scheduler is idle: disarmed before
        # the scheduler computes anything (`yield_lane`); and the steps lanes took before the armed one's
        self.lane = None
        self.lane_steps_done = 0
        self._recent: deque[set[Hashable]] = deque(maxlen=2)  # members of the last two rounds' decode forwards
        self._recent_decode_s: deque[float] = deque(maxlen=2)  # the last two decode rounds' compute times
        self.gate = StragglerGate(config.batch_wait)  # waits for stragglers before a round (or not)
        self._queue: list[Job] = []  # arrival order
        self._running = False  # a round (on the worker) or an inline step (on the caller's thread) is computing
        # the queue's lock, taken as itself (a Condition's `with` is two Python calls more, twice per inline step);
        # the worker waits on the Condition over it
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._stopped = False
        self._worker = threading.Thread(target=self._run, name="swarmlm-compute", daemon=True)
        self._worker.start()

    @property
    def lane_steps(self) -> int:
        """Decode steps step lanes took (server/lane.py): the scheduler was idle for each."""
        return self.lane_steps_done + (self.lane.steps if self.lane is not None else 0)

    def yield_lane(self) -> None:
        """The armed step lane disarmed (its step in flight ends first): the scheduler's compute is next. (On the
        loop's thread, as every submission.)"""
        if self.lane is not None:
            self.lane.disarm()

    @property
    def idle(self) -> bool:
        """Nothing computing or queued. (Read on the loop's thread, which alone submits work: it stays true until that
        thread submits some.)"""
        return not self._running and not self._queue

    @property
    def decodes_inline(self) -> bool:
        """Were the last decode forwards short enough to run on the loop's thread (`_lone_decode`'s time rule)?"""
        return len(self._recent_decode_s) > 0 and max(self._recent_decode_s) <= self.config.inline_decode_max_s

    @property
    def queue_length(self) -> int:
        return len(self._queue)

    # (submit_batchable and submit_step return `_submit`'s coroutine rather than await it: one coroutine frame per
    # step to create and resume, not three; each call costs ~10x its warm time right after a forward)
    def submit_batchable(self, work: Batchable, priority: StepKind,
                         batch_tokens: int) -> Coroutine[Any, Any, tuple[Any, JobTiming]]:
        """Run `work` in a round, batched with queued items of its key; `batch_tokens` (rows x new tokens) is its
        size within the round's budget. (Await the result.)"""
        return self._submit(Job(priority, batch_tokens, 0.0, work))

    def submit_step(
        self, stage: Stage, state: SpanState, hidden: torch.Tensor, mask: torch.Tensor, op: CacheOp | None = None
    ) -> Coroutine[Any, Any, tuple[torch.Tensor, JobTiming]]:
        """One session's step on `stage` (after its cache op): batched with other sessions' steps of the same shape.
        (Await the result.)"""
        request = StepRequest(state, hidden, mask, op)
        work = Batchable(stage.step_batch, request.batch_key, request, member=id(state))
        return self._submit(Job(StepKind.of(hidden.shape[1]), request.batch_tokens, 0.0, work))

    async def _submit(self, job: Job) -> tuple[Any, JobTiming]:
        self.yield_lane()
        with self._lock:
            if self._stopped:
                raise RuntimeError("scheduler is stopped")
            job.enqueued_s = time.perf_counter()
            inline = self._lone_decode(job.priority, job.member)
            if inline:
                self._running = True  # the worker starts no round meanwhile
            else:
                job.waiter = asyncio.get_running_loop().create_future()
                self._queue.append(job)
                self._cv.notify()
        if not inline:
            try:
                return await job.waiter
            except asyncio.CancelledError:
                self._drop(job)  # the caller gave up: a job no round took yet is dropped
                raise
        started = time.perf_counter()
        try:  # (nothing to hand over: the result is returned, an exception raised, as the worker's would be)
            result = job.work.run_batch([job.work.item])[0]
        finally:
            compute_s = time.perf_counter() - started
            self.inline_done(job.member, compute_s)
        return result, JobTiming(started - job.enqueued_s, compute_s)

    def inline_slot(self, member: Hashable) -> bool:
        """Take the caller's thread for a decode step of `member` computed outside `submit_step` (server/service.py's
        one-call answer: kernels/lane.c) when the rule for running a step inline holds (`_lone_decode`): True if
        taken (then call `inline_done` after it, whatever happens), False if the step must go through `submit_step`
        (it would queue or batch with other sessions' steps)."""
        self.yield_lane()
        with self._lock:
            if self._stopped or not self._lone_decode(DECODE, member):
                return False
            self._running = True  # the worker starts no round meanwhile
            return True

    def inline_done(self, member: Hashable, compute_s: float | None) -> None:
        """An inline step of `member` ended: counted with its forward's `compute_s` (the decode rounds' record the
        inline rule and the straggler waits read), or, None, refused before any compute (not counted)."""
        with self._lock:
            if compute_s is None:
                self._running = False
            else:
                self.inline_runs += 1
                self._round_done({member}, compute_s)
            if self._queue:  # work came meanwhile: the worker starts it (else it sleeps on: no wake-up to pay)
                self._cv.notify()

    def _drop(self, job: Job) -> None:
        with self._lock:
            if job in self._queue:  # (identity: jobs compare by it)
                self._queue.remove(job)

    def _lone_decode(self, priority: StepKind, member: Hashable) -> bool:
        """(Holding the lock.) Does a job of `priority` for `member` run on the caller's thread? See the module's
        docstring."""
        return priority == DECODE and self.idle and self.decodes_inline and set().union(*self._recent) <= {member}

    def _run(self) -> None:
        torch.set_num_threads(self.threads)  # this thread does all compute: set its threads explicitly
        while True:
            with self._lock:
                while (not self._queue or self._running) and not self._stopped:
                    self._cv.wait()
                if self._stopped and not self._queue:
                    return
                self._wait_for_stragglers()
                groups = plan_round(self._queue, self.config.max_batch_tokens, self.config.max_prefill_skips)
                chosen = {id(job) for group in groups for job in group}
                self._queue = [job for job in self._queue if id(job) not in chosen]
                self._running = True
            decode, decode_s = set(), 0.0
            for group in groups:
                started = time.perf_counter()
                self._run_group(group)
                if group[0].priority == DECODE:
                    decode |= {job.member for job in group}
                    decode_s += time.perf_counter() - started
            with self._lock:
                self._round_done(decode, decode_s)

    def _round_done(self, decode: set[Hashable], decode_s: float) -> None:
        """(Holding the lock.) A round or an inline step ended; `decode`: the sessions its decode forwards ran."""
        self._running = False
        if decode:
            self._recent.append(decode)
            self._recent_decode_s.append(decode_s)

    def _wait_for_stragglers(self) -> None:
        """(Holding the lock.) Give the recent decode rounds' sessions that are not queued yet a moment to arrive."""
        expected = set().union(*self._recent)
        if not self.gate.may_open(expected):  # (a lone session: nothing more to gather)
            return

        def missing() -> int:
            return len(expected - {job.member for job in self._queue})

        decode_queued = any(job.priority == DECODE for job in self._queue)
        if not self.gate.opens(expected, {job.member for job in self._queue}, decode_queued):
            return
        # the longer of the last two decode rounds: after a round split into many rows + a few, the few's short
        # forward must not shorten the wait that would bring them back together
        before, last_s, started = missing(), max(self._recent_decode_s), time.perf_counter()
        while not self._stopped:
            left = self.gate.wait.left_s(missing(), last_s, time.perf_counter() - started)
            if left <= 0:
                break
            self._cv.wait(left)
        self.gate.ended(before, missing())

    def _run_group(self, group: list[Job]) -> None:
        try:
            self._compute_group(group)
        finally:
            self._deliver(group)

    @staticmethod
    def _deliver(group: list[Job]) -> None:
        """Hand the finished jobs' outcomes to their callers: one call into each caller loop for the whole group."""
        by_loop: dict[asyncio.AbstractEventLoop, list[Job]] = {}
        for job in group:
            if job.waiter is not None:
                by_loop.setdefault(job.waiter.get_loop(), []).append(job)
        for loop, jobs in by_loop.items():
            try:
                loop.call_soon_threadsafe(_resolve_waiters, jobs)
            except RuntimeError:  # that loop is closed: nobody waits for these any more
                pass

    def _compute_group(self, group: list[Job]) -> None:
        started = time.perf_counter()
        work = group[0].work
        try:
            results = work.run_batch([job.work.item for job in group])
        except BaseException as exc:  # the caller decides; the worker keeps serving
            if len(group) == 1:
                group[0].error = exc
                return
            # a failed batch changed no session (steps commit only on success): run each alone, so only the
            # step that fails on its own reports an error
            for job in group:
                self._finish(job, lambda job=job: job.work.run_batch([job.work.item])[0], time.perf_counter())
            return
        compute_s = time.perf_counter() - started
        for job, result in zip(group, results):
            job.outcome = (result, JobTiming(started - job.enqueued_s, compute_s, len(group)))

    @staticmethod
    def _finish(job: Job, fn: Callable[[], Any], started: float) -> None:
        try:
            result = fn()
        except BaseException as exc:  # the caller decides; the worker keeps serving
            job.error = exc
            return
        job.outcome = (result, JobTiming(started - job.enqueued_s, time.perf_counter() - started))

    def stop(self) -> None:
        self.yield_lane()
        with self._lock:
            self._stopped = True
            self._cv.notify_all()
        self._worker.join(timeout=10)
