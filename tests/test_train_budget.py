"""Issue 39, hole 2: training memory has a total. Each training request's estimated memory is bounded
(`max_train_request_bytes`), and so is their sum over the requests admitted at once (`max_train_total_bytes`):
a request that does not fit waits for others to finish (at most `train_admission_wait_s`), then is refused."""
from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
import torch

from swarmlm.config import ServerConfig
from swarmlm.server import training
from swarmlm.server.train_service import TrainBudget
from swarmlm.types import BlockRange
from swarmlm.wire import codec
from swarmlm.wire import swarm_pb2 as pb
from tests.swarm_helpers import in_process_server, stub


def test_the_budget_admits_what_fits_and_refuses_the_rest_after_its_wait():
    async def run() -> list:
        budget = TrainBudget(total=100, wait_s=0.0)
        got = [await budget.acquire(60), await budget.acquire(60), budget.used]  # the second does not fit
        await budget.release(60)
        got += [await budget.acquire(60), budget.used, budget.peak]
        waiting = TrainBudget(total=100, wait_s=60.0)
        await waiting.acquire(100)
        later = asyncio.ensure_future(waiting.acquire(50))  # waits for the release
        await asyncio.sleep(0)
        got.append(later.done())
        await waiting.release(100)
        got += [await later, waiting.used]
        return got

    assert asyncio.run(run()) == [True, False, 60, True, 60, 60, False, True, 50]


def test_a_request_cancelled_as_room_frees_up_reserves_nothing():
    """A waiting request cancelled (its client gone) just after a release woke it, before it ran again: it ends
    cancelled, holding nothing. (3.11's asyncio.wait_for returned the finished wait and dropped the cancellation
    there: the request was admitted and ran on, holding its bytes, for a client that had gone.)"""
    async def run() -> tuple[str, int]:
        budget = TrainBudget(total=100, wait_s=60.0)
        await budget.acquire(100)
        waiting = asyncio.ensure_future(budget.acquire(50))
        for _ in range(5):  # (it takes the lock, finds no room, waits on the condition: two turns of the loop)
            await asyncio.sleep(0)
        await budget.release(100)  # wakes it (nothing here suspends: it has not run again yet)
        waiting.cancel()
        outcome = (await asyncio.gather(waiting, return_exceptions=True))[0]
        return type(outcome).__name__, budget.used

    assert asyncio.run(run()) == ("CancelledError", 0)


def test_a_request_larger_than_the_total_is_a_config_error():
    with pytest.raises(ValueError, match="max_train_request_bytes .* max_train_total_bytes"):
        ServerConfig(model_dir="m", blocks=BlockRange(0, 1), max_train_request_bytes=2 << 20,
                     max_train_total_bytes=1 << 20)


def test_concurrent_backwards_hold_at_most_the_total_and_all_finish(tiny_llama):
    """8 Backwards sent at once, each alone within the per-request bound, the total room for one: the sum admitted
    never passes the total (today's server admitted all 8 at once), every call finishes, and nothing stays held."""
    rows, tokens, blocks = 2, 16, 6
    with in_process_server(tiny_llama, BlockRange(0, blocks)) as probe:
        one = training.backward_bytes(probe.service.stage, blocks, rows, tokens)
        hidden = probe.service.stage.hidden_size
    with in_process_server(tiny_llama, BlockRange(0, blocks), max_train_request_bytes=one,
                           max_train_total_bytes=one, train_admission_wait_s=120.0) as server:
        x, g = torch.randn(rows, tokens, hidden), torch.randn(rows, tokens, hidden)
        request = pb.BackwardRequest(start_block=0, end_block=blocks, hidden=codec.encode(x),
                                     grad_output=codec.encode(g))
        codes = []

        def call() -> None:
            try:
                stub(server.address).Backward(request, timeout=300)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as err:
                codes.append(err.code())

        threads = [threading.Thread(target=call) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        budget = server.service.training.budget
        assert codes == [grpc.StatusCode.OK] * 8
        assert budget.peak <= one and budget.used == 0
