"""Continuous batching: steps of different sessions computed as one forward give each session what it gets alone;
the scheduler runs decode steps first, within a token budget, and never starves a prefill."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from transformers import AutoTokenizer

from swarmlm.config import SchedulerConfig, StragglerWait
from swarmlm.model.checkpoint import load_client_modules
from swarmlm.server.kv_cache import SpanCache
from swarmlm.server.scheduler import (DECODE, PREFILL, RETRY_WAIT_AFTER, Batchable, Job, Scheduler, StragglerGate,
                                      plan_round)
from swarmlm.server.stage import Stage, StepRequest
from swarmlm.types import BlockRange
from tests.swarm_helpers import reference_generate


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    # tiny models: threads only add contention (the machine runs other jobs too)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


PROMPTS = ["the quick brown fox jumps over the lazy dog", "hello", "a b c", "write a short poem about the sea"]


# ---- the stage: batched == alone ---------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["bloom", "llama"])
def family(request, checkpoints):
    path = checkpoints[request.param]
    _, _, client = load_client_modules(path)
    return path, Stage(path, BlockRange(0, 6)), client, AutoTokenizer.from_pretrained(path)


def _embed(client, ids):
    h = client.embed(ids)
    return client.embed_norm(h) if client.embed_norm is not None else h


@torch.no_grad()
def test_batched_greedy_decode_equals_each_session_alone_and_transformers(family):
    """Sessions with different past lengths, batch sizes and left padding: greedy tokens identical, hidden states
    within 1e-4, whether stepped alone or batched; and both equal plain transformers' generate()."""
    path, stage, client, tok = family
    # session 0: two padded rows; sessions 1-3: one row each, prompts of different lengths
    encs = [tok(PROMPTS[:2], return_tensors="pt", padding=True)] + [tok(p, return_tensors="pt") for p in PROMPTS[2:]]
    encs.append(tok(PROMPTS[1], return_tensors="pt"))
    assert (encs[0].attention_mask == 0).any(), "the test needs a padded row"
    new_tokens = 6
    results = {}
    for mode in ("alone", "batched"):
        states = [stage.new_state(stage.blocks, e.input_ids.shape[0]) for e in encs]
        hiddens = [stage.step(s, _embed(client, e.input_ids), e.attention_mask) for s, e in zip(states, encs)]
        tokens = [[] for _ in encs]
        outs = []
        for _ in range(new_tokens):
            nxt = [client.lm_head(client.final_norm(h[:, -1:])).argmax(-1) for h in hiddens]  # [B_i, 1]
            for got, n in zip(tokens, nxt):
                got.append(n)
            steps = [StepRequest(s, _embed(client, n), torch.ones_like(n)) for s, n in zip(states, nxt)]
            hiddens = [stage.step_batch([r])[0] for r in steps] if mode == "alone" else stage.step_batch(steps)
            outs.append(hiddens)
        results[mode] = ([torch.cat(t, 1) for t in tokens], outs)
        assert [s.position for s in states] == [e.input_ids.shape[1] + new_tokens for e in encs]
    for a, b in zip(results["alone"][0], results["batched"][0]):
        assert torch.equal(a, b)
    diff = max((a - b).abs().max().item() for sa, sb in zip(*[results[m][1] for m in results]) for a, b in zip(sa, sb))
    assert diff < 1e-4
    for e, got in zip(encs, results["batched"][0]):
        want = reference_generate(path, e.input_ids, attention_mask=e.attention_mask, max_new_tokens=new_tokens)
        assert torch.equal(want[:, e.input_ids.shape[1]:], got)


@torch.no_grad()
def test_batched_prefill_chunks_on_a_sub_range_equal_alone(family):
    """Equal-length chunks of sessions with different pasts, on blocks [1, 4) of a [0, 6) stage, batch exactly."""
    _, stage, _, _ = family
    gen = torch.Generator().manual_seed(3)
    h = stage.hidden_size
    pasts = [0, 4, 9]
    pads = [torch.tensor([[0, 0, 1, 1, 1]]), torch.ones(1, 5, dtype=torch.long), torch.tensor([[1, 1, 1, 1, 1]])]
    sub = BlockRange(1, 4)
    pairs = []
    for past in pasts:
        a, b = stage.new_state(sub, 1), stage.new_state(sub, 1)
        if past:
            x = torch.randn(1, past, h, generator=gen)
            stage.step(a, x, torch.ones(1, past, dtype=torch.long))
            stage.step(b, x, torch.ones(1, past, dtype=torch.long))
        pairs.append((a, b))
    for _ in range(2):  # two rounds of 5-token chunks, then a decode round
        xs = [torch.randn(1, 5, h, generator=gen) for _ in pasts]
        alone = [stage.step(a, x, m) for (a, _), x, m in zip(pairs, xs, pads)]
        batched = stage.step_batch([StepRequest(b, x, m) for (_, b), x, m in zip(pairs, xs, pads)])
        for got, want, m in zip(batched, alone, pads):
            real = m[0].bool()  # outputs at padded positions are never read by anyone
            assert (got[:, real] - want[:, real]).abs().max().item() < 1e-4
    xs = [torch.randn(1, 1, h, generator=gen) for _ in pasts]
    one = torch.ones(1, 1, dtype=torch.long)
    alone = [stage.step(a, x, one) for (a, _), x in zip(pairs, xs)]
    batched = stage.step_batch([StepRequest(b, x, one) for (_, b), x in zip(pairs, xs)])
    assert max((g - w).abs().max().item() for g, w in zip(batched, alone)) < 1e-4
    assert [b.position for _, b in pairs] == [p + 11 for p in pasts]


@torch.no_grad()
def test_a_failed_batch_changes_no_session(tiny_bloom, monkeypatch):
    stage = Stage(tiny_bloom, BlockRange(0, 3))
    h = stage.hidden_size
    gen = torch.Generator().manual_seed(1)
    states, reference = [], []  # the same sessions twice: one pair sees a failure, the other never does
    for past in (3, 5):
        x = torch.randn(1, past, h, generator=gen)
        for group in (states, reference):
            group.append(stage.new_state(stage.blocks, 1))
            stage.step(group[-1], x, torch.ones(1, past, dtype=torch.long))
    before = [(s.position, s.cache.length) for s in states]
    xs = [torch.randn(1, 1, h, generator=gen) for _ in states]
    one = torch.ones(1, 1, dtype=torch.long)

    def boom(*args, **kwargs):  # the last block fails after blocks 0 and 1 wrote their new K/V
        raise RuntimeError("boom")

    monkeypatch.setattr(stage.modules[-1], "forward", boom)
    with pytest.raises(RuntimeError, match="boom"):
        stage.step_batch([StepRequest(s, x, one) for s, x in zip(states, xs)])
    assert [(s.position, s.cache.length) for s in states] == before
    monkeypatch.undo()
    retried = stage.step_batch([StepRequest(s, x, one) for s, x in zip(states, xs)])
    want = stage.step_batch([StepRequest(s, x, one) for s, x in zip(reference, xs)])
    for got, expected in zip(retried, want):
        assert torch.equal(got, expected)


def test_cache_grows_by_doubling_up_to_the_sessions_max_length():
    cache = SpanCache(num_layers=2, max_length=11)
    kv = torch.randn(1, 2, 5, 4)  # [B, heads, T, head_dim]
    cache.write(1, kv, kv)
    cache.commit(5)
    capacities = []
    for _ in range(6):
        one = torch.randn(1, 2, 1, 4)
        end = cache.write(0, one, one)
        cache.write(1, one, one)
        cache.commit(1)
        capacities.append(cache.capacity)
    assert capacities == [10, 10, 10, 10, 10, 11]  # doubled once, then capped at max_length
    keys, _ = cache.view(1, end)
    assert keys.shape == (1, 2, 11, 4) and torch.equal(keys[:, :, :5], kv)  # growth kept what was written


# ---- round planning (pure) ---------------------------------------------------------------------------------------
def _job(priority: int, batch_tokens: int, key="k", member=None) -> Job:
    member = member if member is not None else object()
    return Job(priority, batch_tokens, 0.0, work=Batchable(_noop, key, None, member))


def _noop(items):
    return items


def test_round_runs_decodes_first_grouped_by_key_then_prefills():
    p = _job(PREFILL, 4, key="p")
    d1, d2, d3 = _job(DECODE, 1, "x"), _job(DECODE, 1, "y"), _job(DECODE, 1, "x")
    assert plan_round([p, d1, d2, d3], max_tokens=100, max_prefill_skips=2) == [[d1, d3], [d2], [p]]


def test_round_respects_the_token_budget_in_arrival_order():
    decodes = [_job(DECODE, 1) for _ in range(5)]
    big = _job(DECODE, 3)
    p = _job(PREFILL, 2, key="p")
    assert plan_round(decodes + [p], max_tokens=3, max_prefill_skips=2) == [decodes[:3]]
    assert p.skipped == 1
    # a decode that does not fit stops the round: the smaller one behind it does not overtake it
    assert plan_round([decodes[0], big, decodes[1]], max_tokens=3, max_prefill_skips=2) == [[decodes[0]]]
    # a job larger than the whole budget still runs, alone
    assert plan_round([big], max_tokens=2, max_prefill_skips=2) == [[big]]


def test_a_session_runs_at_most_one_step_per_round():
    member = object()
    a, b = _job(DECODE, 1, member=member), _job(DECODE, 1, member=member)
    assert plan_round([a, b], max_tokens=10, max_prefill_skips=2) == [[a]]


@pytest.mark.parametrize("max_skips", [0, 1, 2, 5])
def test_prefill_is_never_starved_by_a_stream_of_decodes(max_skips):
    """Fairness bound: with the budget always full of decodes, the oldest prefill runs in round max_skips + 1."""
    prefill, later = _job(PREFILL, 8, key="p"), _job(PREFILL, 1, key="p")
    for round_no in range(1, 100):
        queue = [_job(DECODE, 1) for _ in range(4)] + [prefill, later]
        groups = plan_round(queue, max_tokens=4, max_prefill_skips=max_skips)
        ran = [job for group in groups for job in group]
        assert later not in ran or prefill in ran, "a later prefill overtook the oldest one"
        if prefill in ran:
            break
        assert len(ran) == 4  # decodes only, the budget is full
    assert round_no == max_skips + 1
    assert ran[:4] == queue[:4]  # even then, the round's decodes run first


# ---- the scheduler thread with a real stage -----------------------------------------------------------------------
async def _until(condition, timeout_s: float = 60.0) -> None:
    """Poll (a busy machine may take a while to run the worker thread) instead of sleeping a guessed time."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def _blocker(hold: threading.Event, running: threading.Event) -> Batchable:
    """Work that keeps the worker thread busy until `hold` is set; `running` tells it has started. Submitted as a
    prefill, so no decode round is recorded for it."""
    def block(items: list) -> list:
        running.set()
        hold.wait(120)
        return [None] * len(items)
    return Batchable(block, "blocker", None, "blocker")


async def _busy(scheduler: Scheduler, hold: threading.Event, running: threading.Event) -> asyncio.Future:
    """The worker thread held busy by `_blocker` (started): what is submitted next queues up for one round."""
    blocker = asyncio.ensure_future(scheduler.submit_batchable(_blocker(hold, running), PREFILL, 1))
    await _until(running.is_set)
    return blocker


def test_scheduler_batches_concurrent_decode_steps(tiny_llama):
    stage = Stage(tiny_llama, BlockRange(0, 6))
    h = stage.hidden_size
    gen = torch.Generator().manual_seed(0)
    pasts = [2, 7, 4, 11]
    alone_states = [stage.new_state(stage.blocks, 1) for _ in pasts]
    states = [stage.new_state(stage.blocks, 1) for _ in pasts]
    for a, s, past in zip(alone_states, states, pasts):
        x = torch.randn(1, past, h, generator=gen)
        stage.step(a, x, torch.ones(1, past, dtype=torch.long))
        stage.step(s, x, torch.ones(1, past, dtype=torch.long))
    xs = [torch.randn(1, 1, h, generator=gen) for _ in pasts]
    one = torch.ones(1, 1, dtype=torch.long)
    want = [stage.step(a, x, one) for a, x in zip(alone_states, xs)]
    prompt_state = stage.new_state(stage.blocks, 1)
    scheduler = Scheduler(1, SchedulerConfig(max_batch_tokens=64))
    hold, running = threading.Event(), threading.Event()
    order: list[str] = []

    async def main():
        blocker = await _busy(scheduler, hold, running)

        async def step(name, state, x, mask):
            out = await scheduler.submit_step(stage, state, x, mask)
            order.append(name)
            return out

        prefill = asyncio.ensure_future(step("prefill", prompt_state, torch.randn(1, 6, h), torch.ones(1, 6, dtype=torch.long)))
        decodes = [asyncio.ensure_future(step(f"d{i}", s, x, one)) for i, (s, x) in enumerate(zip(states, xs))]
        await _until(lambda: scheduler.queue_length == 5)
        hold.set()
        await blocker
        return await asyncio.gather(*decodes), await prefill

    try:
        decoded, (_, prefill_timing) = asyncio.run(main())
    finally:
        scheduler.stop()
    assert order[-1] == "prefill"  # queued first, run after the decode batch
    for (out, timing), expected in zip(decoded, want):
        assert timing.batched_steps == 4 and timing.compute_s > 0 and timing.queued_s > 0
        assert (out - expected).abs().max().item() < 1e-4
    assert len({t.compute_s for _, t in decoded}) == 1  # each member reports the batch's compute time
    assert prefill_timing.batched_steps == 1 and prompt_state.position == 6


def test_a_failing_item_fails_alone():
    def run_batch(items):
        if "bad" in items:
            raise ValueError("bad item")
        return [f"{i}!" for i in items]

    scheduler = Scheduler(1)
    hold, running = threading.Event(), threading.Event()

    async def main():
        blocker = await _busy(scheduler, hold, running)
        jobs = [
            asyncio.ensure_future(scheduler.submit_batchable(Batchable(run_batch, "k", item, item), DECODE, 1))
            for item in ("a", "bad", "c")
        ]
        await _until(lambda: scheduler.queue_length == 3)  # one round: the three share a forward that fails
        hold.set()
        await blocker
        return await asyncio.gather(*jobs, return_exceptions=True)

    try:
        a, bad, c = asyncio.run(main())
    finally:
        scheduler.stop()
    assert a[0] == "a!" and c[0] == "c!"
    assert isinstance(bad, ValueError)


def test_a_batchs_results_reach_the_callers_loop_in_one_wake_up():
    """Each call into another thread's event loop writes to its self-pipe (a syscall, a wake-up of that thread):
    the 4 members of one forward are handed back with ONE call, not one per member (docs/RESULTS-packed.md round
    11); each still gets its own result."""
    scheduler = Scheduler(1)
    hold, running = threading.Event(), threading.Event()
    calls_from_worker: list[str] = []

    async def main():
        loop = asyncio.get_running_loop()
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counted(callback, *args, **kwargs):
            if threading.current_thread() is scheduler._worker:
                calls_from_worker.append(getattr(callback, "__name__", repr(callback)))
            return call_soon_threadsafe(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted
        blocker = await _busy(scheduler, hold, running)
        times_ten = lambda items: [i * 10 for i in items]  # (one function: items batch only with equal run_batch)
        jobs = [asyncio.ensure_future(scheduler.submit_batchable(Batchable(times_ten, "k", i, member=i), DECODE, 1))
                for i in range(4)]
        await _until(lambda: scheduler.queue_length == 4)
        hold.set()
        await blocker
        return await asyncio.gather(*jobs)

    try:
        results = asyncio.run(main())
    finally:
        scheduler.stop()
    assert [r for r, _ in results] == [0, 10, 20, 30]
    assert all(timing.batched_steps == 4 for _, timing in results)
    assert len(calls_from_worker) == 2, calls_from_worker  # the blocker's forward, then the batch of 4


def test_a_step_whose_caller_gave_up_before_its_round_is_not_run():
    ran: list[str] = []

    def run_batch(items):
        ran.extend(items)
        return [f"{i}!" for i in items]

    scheduler = Scheduler(1)
    hold, running = threading.Event(), threading.Event()

    async def main():
        blocker = await _busy(scheduler, hold, running)
        gone, kept = (asyncio.ensure_future(scheduler.submit_batchable(Batchable(run_batch, "k", item, item),
                                                                       DECODE, 1)) for item in ("gone", "kept"))
        await _until(lambda: scheduler.queue_length == 2)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        await asyncio.sleep(0)  # (the waiter's done-callbacks run)
        hold.set()
        await blocker
        return await kept

    try:
        result, timing = asyncio.run(main())
    finally:
        scheduler.stop()
    assert result == "kept!" and ran == ["kept"] and timing.batched_steps == 1


def _lockstep(scheduler: Scheduler, sessions: int, rounds, return_s) -> list[list[int]]:
    """`sessions` clients in lockstep: each waits `return_s(i)` after its reply (its round trip) and sends its next
    step, `rounds` steps (or `rounds[i]` for session i); a forward takes 20 ms. Returns the batch sizes each
    session saw, in order."""
    def forward(items):
        time.sleep(0.02)
        return list(items)

    seen: list[list[int]] = [[] for _ in range(sessions)]
    steps = [rounds] * sessions if isinstance(rounds, int) else list(rounds)

    async def session(i: int) -> None:
        for _ in range(steps[i]):
            _, timing = await scheduler.submit_batchable(Batchable(forward, "decode", i, member=i), DECODE, 1)
            seen[i].append(timing.batched_steps)
            await asyncio.sleep(return_s(i))

    async def main() -> None:
        await asyncio.gather(*(session(i) for i in range(sessions)))

    try:
        asyncio.run(main())
    finally:
        scheduler.stop()
    return seen


# The wait's bounds below are generous (up to 2 s where the product waits 10 ms): stragglers come back within
# 10-40 ms, so how long a busy machine delays a thread does not decide which rounds form. The product's own
# setting is measured in benchmarks/batching_bench.py. Whether a wait starts at all is StragglerGate's decision,
# tested without a clock below.
WAIT = SchedulerConfig(batch_wait=StragglerWait(fraction=100.0, max_s=2.0))


def test_sessions_in_lockstep_share_a_forward_when_the_server_waits_for_stragglers():
    staggered = lambda i: 0.01 * (i + 1)  # replies come back 10-40 ms apart (a forward takes 20 ms)
    with_wait = _lockstep(Scheduler(1, WAIT), 4, 12, staggered)
    assert all(b == 4 for s in with_wait for b in s[3:]), with_wait  # once in step, every round holds all four
    pair = _lockstep(Scheduler(1, WAIT), 2, 8, staggered)
    assert all(b == 2 for s in pair for b in s[2:]), pair


def test_straggler_gate_waits_only_for_someone_expected_and_stops_when_waits_do_not_pay():
    """StragglerGate, the scheduler's whole decision to wait before a round, as a pure function of what it sees."""
    gate = StragglerGate(StragglerWait(fraction=0.1, max_s=0.002))
    pair, one = {"a", "b"}, {"a"}
    assert not gate.opens(one, set(), decode_queued=True)  # a lone session: nobody else is expected
    assert not gate.opens(pair, pair, decode_queued=True)  # everyone expected is queued: run now
    assert not gate.opens(pair, one, decode_queued=False)  # only prefill work queued: it goes at once
    assert not StragglerGate(StragglerWait(0.0, 1.0)).opens(pair, one, decode_queued=True)  # switched off
    assert gate.opens(pair, one, decode_queued=True)
    gate.ended(missing_before=1, missing_after=0)  # the straggler came: waits pay
    assert gate.fruitless == 0
    # "b" comes back far too late for every wait (a slow link): after 4 fruitless waits, the next 8 are skipped,
    # then one is tried again
    decisions = []
    for _ in range(4 + RETRY_WAIT_AFTER + 1):
        opened = gate.opens(pair, one, decode_queued=True)
        decisions.append(opened)
        if opened:
            gate.ended(missing_before=1, missing_after=1)
    assert decisions == [True] * 4 + [False] * RETRY_WAIT_AFTER + [True], decisions
    assert gate.fruitless == 5 and gate.skipped == 0
    gate.ended(missing_before=1, missing_after=0)  # that one gathered "b": waits resume
    assert gate.opens(pair, one, decode_queued=True)


def _threads_of(scheduler: Scheduler, plan: list[list[str]], forward_s: float = 0.0) -> list[list[tuple[str, int]]]:
    """Runs rounds of decode steps: each round submits its members' items at once and waits for all of them.
    Returns, per round, the thread each item's forward ran on and its batch size."""
    def forward(items):
        time.sleep(forward_s)
        if any("bad" in item for item in items):
            raise ValueError("bad item")
        return [threading.current_thread().name] * len(items)

    async def main():
        out = []
        for members in plan:
            jobs = [scheduler.submit_batchable(Batchable(forward, "decode", m, member=m[0]), DECODE, 1)
                    for m in members]
            results = await asyncio.gather(*jobs, return_exceptions=True)
            out.append([("error", 0) if isinstance(r, Exception) else (r[0], r[1].batched_steps) for r in results])
            # the worker hands out results before it marks its round done: a step submitted in between goes to
            # it, whatever the rule says (a race a busy machine makes likely), so each round starts on an idle one
            await _until(lambda: not scheduler._running)
        return out

    try:
        return asyncio.run(main())
    finally:
        scheduler.stop()


def test_a_lone_sessions_decode_steps_skip_the_hand_off_to_the_compute_thread():
    main_thread = threading.current_thread().name  # asyncio.run's loop runs on it
    rounds = _threads_of(scheduler := Scheduler(1), [["a"]] * 5)
    # the first step goes to the worker (no forward time known yet); once the last decode rounds held only this
    # session and were short, its steps run on the caller's thread
    assert [r[0][0] for r in rounds] == ["swarmlm-compute"] + [main_thread] * 4, rounds
    assert scheduler.inline_runs == 4
    # a second session: both go to the worker and share forwards; alone again, the first goes back to inline
    plan = [["a"], ["a"], ["a", "b"], ["a", "b"], ["a", "b"], ["a"], ["a"], ["a"], ["a"]]
    rounds = _threads_of(Scheduler(1), plan)
    # "a" comes first and runs inline ("b" is new); "b", queued meanwhile, goes to the worker
    assert rounds[2] == [(main_thread, 1), ("swarmlm-compute", 1)], rounds
    assert rounds[3] == rounds[4] == [("swarmlm-compute", 2)] * 2, rounds  # from then on they batch
    assert rounds[5][0][0] == "swarmlm-compute"  # "b" is still among the last two rounds' sessions
    assert rounds[-1][0][0] == main_thread, rounds
    # a failing step inline fails alone and changes nothing for the next one
    rounds = _threads_of(Scheduler(1), [["a"], ["a"], ["abad"], ["a"]])
    assert rounds[2] == [("error", 0)] and rounds[3] == [(main_thread, 1)], rounds


def test_no_inline_decode_when_switched_off_or_when_a_forward_is_long():
    off = _threads_of(Scheduler(1, SchedulerConfig(inline_decode_max_s=0)), [["a"]] * 4)
    assert all(r[0][0] == "swarmlm-compute" for r in off), off
    # a forward longer than the limit would block the server's I/O loop that long: it stays on the worker
    slow = _threads_of(Scheduler(1, SchedulerConfig(inline_decode_max_s=0.01)), [["a"]] * 4, forward_s=0.05)
    assert all(r[0][0] == "swarmlm-compute" for r in slow), slow
    with pytest.raises(ValueError, match="inline_decode_max_s"):
        SchedulerConfig(inline_decode_max_s=-1)


def test_a_float32_bloomz_length_forward_runs_inline_by_default():
    # a lone session's 60 ms forward (a float32 bloomz-560m span takes 60-100 ms here) skips the two hand-offs too
    main_thread = threading.current_thread().name
    rounds = _threads_of(Scheduler(1), [["a"]] * 3, forward_s=0.06)
    assert [r[0][0] for r in rounds] == ["swarmlm-compute", main_thread, main_thread], rounds


def test_one_straggler_wait_rule_for_server_rounds_and_client_heads():
    """config.StragglerWait.left_s decides both waits (server/scheduler.py, client/head_batcher.py): no clock."""
    wait = StragglerWait(fraction=0.5, max_s=0.01)
    assert wait.left_s(missing=0, last_batch_s=1.0, waited_s=0.0) == 0.0  # everyone expected is here: run now
    assert wait.left_s(missing=2, last_batch_s=0.004, waited_s=0.0) == pytest.approx(0.002)  # half the last batch
    assert wait.left_s(missing=2, last_batch_s=0.004, waited_s=0.0015) == pytest.approx(0.0005)
    assert wait.left_s(missing=2, last_batch_s=0.004, waited_s=0.003) == 0.0  # spent
    assert wait.left_s(missing=1, last_batch_s=1.0, waited_s=0.0) == 0.01  # capped at max_s
    assert StragglerWait(fraction=0.0, max_s=1.0).left_s(missing=3, last_batch_s=1.0, waited_s=0.0) == 0.0  # off
    with pytest.raises(ValueError, match="must be >= 0"):
        StragglerWait(fraction=-1.0, max_s=1.0)
