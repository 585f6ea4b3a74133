"""Garbage-collector pauses (swarmlm/collector.py): a ready server process has frozen its start-up heap and says so
in Info with its collections (to callers trusted with counters); freezing, thawing and counting do what the server
relies on: a frozen cycle outlives collections until thawed (why a server moving blocks thaws first)."""
from __future__ import annotations

import gc
import weakref

import pytest

from swarmlm.collector import GENERATIONS, collection_times, freeze_start_up, thawed
from swarmlm.swarm.local import even_split
from swarmlm.wire import swarm_pb2 as pb
from tests.swarm_helpers import client_of, greedy_steps, server_processes, stub


@pytest.fixture
def unfrozen_after():
    """This test process's heap thawed again after the test (pytest's own objects are not ours to freeze)."""
    yield
    gc.unfreeze()


class Node:
    def __init__(self) -> None:
        self.other = self  # a cycle: only a collection frees it


def test_a_ready_server_process_has_frozen_its_start_up_heap_and_reports_its_collections(tiny_bloom):
    with server_processes(tiny_bloom, even_split(6, 2), dht=False, server_args=["--publish-counters"]) as swarm:
        before = [stub(a).Info(pb.InfoRequest(), timeout=30).gc for a in swarm.addresses]
        client = client_of(swarm)
        try:
            import torch

            ids = torch.randint(10, 250, (1, 8), generator=torch.Generator().manual_seed(1))
            with client.inference_session(max_length=8 + 50) as session:
                for _ in greedy_steps(client, session, ids, 50):
                    pass
        finally:
            client.close()
        after = [stub(a).Info(pb.InfoRequest(), timeout=30).gc for a in swarm.addresses]
    for b, a in zip(before, after):
        # torch, the blocks, the imports: tens of thousands of objects whatever the model; serving freezes nothing
        # more (frozen objects may still die: reference counting frees them)
        assert 10_000 < a.frozen_objects <= b.frozen_objects
        assert len(a.collections) == len(a.seconds) == len(a.longest_s) == GENERATIONS
        assert all(x >= y for x, y in zip(a.collections, b.collections))  # (counted since it started serving)


def test_freeze_takes_the_heap_out_of_collections_and_thawed_gives_it_back(unfrozen_after):
    node = Node()
    alive = weakref.ref(node)
    frozen = freeze_start_up()
    assert frozen > 0 and gc.get_freeze_count() > 0  # (not equal: reference counting frees frozen objects too)
    del node
    gc.collect()
    assert alive() is not None  # frozen: no collection walks it
    with thawed():
        assert gc.get_freeze_count() == 0
        gc.collect()
        assert alive() is None  # thawed: collected
    assert gc.get_freeze_count() > 0  # frozen again, with what is alive now


def test_thawed_freezes_nothing_in_a_process_that_froze_nothing(unfrozen_after):
    gc.unfreeze()
    with thawed():
        pass
    assert gc.get_freeze_count() == 0  # (a test's in-process server moving blocks leaves the test's heap alone)


def test_collection_times_count_each_collection_by_generation():
    times = collection_times()
    assert collection_times() is times  # one callback per process
    assert gc.callbacks.count(times.callback) == 1
    before = times.snapshot()
    gc.collect(1)
    gc.collect(2)
    since = times.since(before)
    assert since.collections[1] >= 1 and since.collections[2] >= 1
    assert all(s >= 0 for s in since.seconds) and times.longest_s[2] >= 0
