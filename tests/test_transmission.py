"""The per-link transmission scheduler: decode first, bounded decode bursts, the prefill window, arrival order when
decode-first is off, and cancellation that leaves the link usable."""
from __future__ import annotations

import asyncio

import pytest

from swarmlm.types import StepKind
from swarmlm.wire.links import LinkScheduler, TransmissionPolicy

D, P = StepKind.DECODE, StepKind.PREFILL


async def _write_order(link: LinkScheduler, kinds: list[StepKind], answer_prefill: bool = True) -> list[int]:
    """Queue messages (all before the first write finishes) and return the order they were written in.
    Prefill replies arrive right after their write when answer_prefill (the window never fills)."""
    order: list[int] = []
    hold = asyncio.Event()

    async def one(i: int, kind: StepKind) -> None:
        async with link.turn(kind):
            order.append(i)
            if i == 0:
                await hold.wait()  # the first write takes a while: everything else queues behind it
        if answer_prefill or kind is D:
            link.answered(kind)

    tasks = [asyncio.ensure_future(one(i, k)) for i, k in enumerate(kinds)]
    await asyncio.sleep(0)
    hold.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    return order


def test_decode_messages_pass_queued_prefill_chunks():
    link = LinkScheduler(TransmissionPolicy(decode_first=True, max_decode_burst=8, prefill_window=None))
    order = asyncio.run(_write_order(link, [P, P, P, D, P, D]))
    assert order == [0, 3, 5, 1, 2, 4]
    assert link.stats.overtakes == 2


def test_arrival_order_without_decode_first():
    link = LinkScheduler(TransmissionPolicy(decode_first=False, prefill_window=None))
    assert asyncio.run(_write_order(link, [P, P, P, D, P, D])) == [0, 1, 2, 3, 4, 5]
    assert link.stats.overtakes == 0


def test_a_prefill_chunk_goes_after_at_most_k_decodes():
    link = LinkScheduler(TransmissionPolicy(decode_first=True, max_decode_burst=2, prefill_window=None))
    order = asyncio.run(_write_order(link, [D, P, D, D, D, D, D, P]))
    # after the first write: decodes 2 and 3 pass chunk 1, then it must go; then 4, 5 pass chunk 7; then 7; then 6
    assert order == [0, 2, 3, 1, 4, 5, 7, 6]
    assert link.stats.forced_prefill == 2


def test_decode_burst_limit_only_counts_when_a_chunk_could_go():
    """With the window full, decodes do not use up the chunk's fairness credit."""
    link = LinkScheduler(TransmissionPolicy(decode_first=True, max_decode_burst=1, prefill_window=1))

    async def run() -> list[str]:
        log: list[str] = []
        async with link.turn(P):  # one chunk in flight: the window (1) is full until it is answered
            log.append("p0")

        async def msg(name: str, kind: StepKind) -> None:
            async with link.turn(kind):
                log.append(name)
            if kind is D:
                link.answered(kind)

        tasks = [asyncio.ensure_future(msg(n, k)) for n, k in [("p1", P), ("d1", D), ("d2", D), ("d3", D)]]
        await asyncio.sleep(0.01)
        assert log == ["p0", "d1", "d2", "d3"]  # the held chunk does not block decodes, nor count against them
        link.answered(P)  # p0's reply: the window opens
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        return log

    assert asyncio.run(run()) == ["p0", "d1", "d2", "d3", "p1"]


def test_prefill_window_holds_chunks_until_answered():
    link = LinkScheduler(TransmissionPolicy(prefill_window=2))

    async def run() -> None:
        written: list[int] = []

        async def chunk(i: int) -> None:
            async with link.turn(P):
                written.append(i)

        tasks = [asyncio.ensure_future(chunk(i)) for i in range(4)]
        await asyncio.sleep(0.01)
        assert written == [0, 1] and link.prefill_in_flight == 2
        link.answered(P)
        await asyncio.sleep(0.01)
        assert written == [0, 1, 2]
        link.answered(P)
        link.answered(P)
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert written == [0, 1, 2, 3]

    asyncio.run(run())


def test_without_decode_first_a_held_chunk_blocks_the_decodes_behind_it():
    link = LinkScheduler(TransmissionPolicy(decode_first=False, prefill_window=1))

    async def run() -> None:
        written: list[str] = []

        async def msg(name: str, kind: StepKind) -> None:
            async with link.turn(kind):
                written.append(name)

        tasks = [asyncio.ensure_future(msg(n, k)) for n, k in [("p0", P), ("p1", P), ("d0", D)]]
        await asyncio.sleep(0.01)
        assert written == ["p0"]  # p1 waits for p0's reply; d0 arrived after p1, so it waits too
        link.answered(P)
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert written == ["p0", "p1", "d0"]

    asyncio.run(run())


def test_cancelled_waiters_leave_the_link_usable():
    link = LinkScheduler(TransmissionPolicy(prefill_window=1))

    async def run() -> None:
        async with link.turn(P):
            pass  # in flight, never answered yet: the window is full
        waiting = asyncio.ensure_future(link.turn(P).__aenter__())
        await asyncio.sleep(0.01)
        assert link.waiting == [P]
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        link.answered(P)  # must not try to grant the cancelled waiter
        assert link.waiting == [] and link.prefill_in_flight == 0
        async with link.turn(D):
            pass
        assert link.stats.written == {D: 1, P: 1}

    asyncio.run(run())


def test_policy_bounds():
    with pytest.raises(ValueError):
        TransmissionPolicy(max_decode_burst=0)
    with pytest.raises(ValueError):
        TransmissionPolicy(prefill_window=0)


def test_policy_from_client_config():
    from swarmlm.wire.links import TransmissionPolicy
    from swarmlm.config import ClientConfig

    on = TransmissionPolicy.for_client(ClientConfig(prefill_chunk_tokens=None, decode_first=True, max_decode_burst=3, prefill_window=4))
    assert (on.decode_first, on.max_decode_burst, on.prefill_window) == (True, 3, 4)
    off = TransmissionPolicy.for_client(ClientConfig(prefill_chunk_tokens=0, decode_first=False))
    assert (off.decode_first, off.prefill_window) == (False, None)  # whole prompts are never held back
    with pytest.raises(ValueError):
        ClientConfig(prefill_chunk_tokens=-1)


def test_chunking_is_on_by_default_and_the_cli_spelling_maps_to_the_config():
    import argparse

    from swarmlm.cli.args import add_prefill_chunks
    from swarmlm.config import ClientConfig

    assert ClientConfig().prefill_chunk_tokens is None  # auto: measured to help on slow links, neutral on loopback
    p = argparse.ArgumentParser(exit_on_error=False)
    add_prefill_chunks(p)
    assert [p.parse_args(a).prefill_chunks for a in ([], ["--prefill-chunks", "auto"], ["--prefill-chunks", "off"],
                                                     ["--prefill-chunks", "32"])] == [None, None, 0, 32]
    for bad in ("0", "-4", "lots"):
        with pytest.raises(argparse.ArgumentError, match="auto"):
            p.parse_args(["--prefill-chunks", bad])
