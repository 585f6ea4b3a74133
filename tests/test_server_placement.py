"""A server without --blocks asks the planner, with the swarm's announced records, where to go."""
from __future__ import annotations

import dataclasses
import random
import threading
import time

import pytest

from swarmlm.config import ServerConfig
from swarmlm.server.placement import (
    LoadingWatch, ahead_of, block_throughput, choose_blocks, choose_blocks_from, first_loader, model_spec, settle,
    should_move, uncovered,
)
from swarmlm.swarm.records import JOINING, LOADING, ServerRecord
from swarmlm.types import BlockRange


def rec(sid: str, start: int, end: int, decode_s: float = 0.001) -> ServerRecord:
    return ServerRecord(server_id=sid, address="127.0.0.1:1", start=start, end=end, decode_s=decode_s,
                        cache_bytes_total=256 << 20)


def test_model_spec_measures_block_bytes(tiny_bloom):
    spec = model_spec(ServerConfig(model_dir=tiny_bloom, blocks=None))
    h = 64  # tiny-bloom: qkv 3h^2+3h, dense h^2+h, mlp 8h^2+5h, two layer norms 4h
    assert spec.num_blocks == 6 and spec.block_bytes == 4 * (12 * h * h + 13 * h)


def test_petals_rule_takes_the_least_served_window(tiny_bloom):
    cfg = ServerConfig(model_dir=tiny_bloom, blocks=None, num_blocks=2)
    model = model_spec(cfg)
    records = {"a": rec("a", 0, 4), "b": rec("b", 0, 2)}
    assert choose_blocks_from(cfg, records, model) == BlockRange(4, 6)
    # everything served once, a slow server on [2, 4): its blocks have the least throughput
    records = {"a": rec("a", 0, 6), "slow": rec("slow", 2, 4, decode_s=0.01)}
    assert choose_blocks_from(cfg, {"a": rec("a", 0, 6)}, model) == BlockRange(0, 2)
    assert choose_blocks_from(cfg, records, model) in (BlockRange(0, 2), BlockRange(4, 6))


def test_cg_bprr_covers_missing_blocks_first(tiny_bloom):
    cfg = ServerConfig(model_dir=tiny_bloom, blocks=None, num_blocks=3, placement="cg-bprr")
    model = model_spec(cfg)
    got = choose_blocks_from(cfg, {"a": rec("a", 0, 3)}, model)
    assert got == BlockRange(3, 6)


def test_rebalancing_moves_only_for_a_real_gain(tiny_bloom):
    cfg = ServerConfig(model_dir=tiny_bloom, blocks=None, num_blocks=3)
    model = model_spec(cfg)
    me = rec("me", 0, 3)
    # blocks 3-5 uncovered: moving there raises the weakest block from 0
    assert should_move(cfg, me, {"me": me, "a": rec("a", 0, 3)}, model) == BlockRange(3, 6)
    # balanced swarm: stay
    assert should_move(cfg, me, {"me": me, "a": rec("a", 3, 6)}, model) is None
    assert min(block_throughput({"me": me, "a": rec("a", 3, 6)}, 6)) > 0


def test_a_joiner_yields_to_servers_that_serve_load_or_joined_before_it():
    me = ServerRecord(server_id="m", address="h:1", start=0, end=1, state=JOINING, joined_at=10.0)
    joiner = dict(address="h:1", start=0, end=1, state=JOINING)
    records = {
        "m": me, "serving": rec("serving", 0, 2),
        "loading": ServerRecord(server_id="loading", address="h:1", start=0, end=1, state=LOADING, joined_at=20.0),
        "earlier": ServerRecord(server_id="earlier", joined_at=5.0, **joiner),
        "later": ServerRecord(server_id="later", joined_at=15.0, **joiner),
        "a": ServerRecord(server_id="a", joined_at=10.0, **joiner),  # the same instant: the smaller id goes first
        "z": ServerRecord(server_id="z", joined_at=10.0, **joiner),
    }
    assert set(ahead_of(me, records)) == {"serving", "loading", "earlier", "a"}


def test_a_joiner_takes_the_typical_speed_until_it_measured_its_own():
    records = {"a": rec("a", 0, 3, decode_s=0.01), "b": rec("b", 3, 6, decode_s=0.02),
               "new": ServerRecord(server_id="new", address="h:1", start=0, end=6, state=JOINING)}
    assert block_throughput(records, 6) == pytest.approx([100 + 75] * 3 + [50 + 75] * 3)


class Board:
    """The records joiners see, as the DHT shows them: a stored record becomes visible `delay_s` later (thread-safe)."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.stored: dict[str, list[tuple[float, ServerRecord]]] = {}  # server id -> (visible from, record)
        self.lock = threading.Lock()

    def fetch(self) -> dict[str, ServerRecord]:
        now = time.monotonic()
        with self.lock:
            return {sid: [r for t, r in versions if t <= now][-1] for sid, versions in self.stored.items()
                    if versions[0][0] <= now}

    def announce(self, record: ServerRecord) -> None:
        with self.lock:
            self.stored.setdefault(record.server_id, []).append((time.monotonic() + self.delay_s, record))

    @property
    def records(self) -> dict[str, ServerRecord]:
        with self.lock:
            return {sid: versions[-1][1] for sid, versions in self.stored.items()}


@pytest.mark.parametrize("seed", range(5))
def test_servers_placing_themselves_together_cover_the_model(tiny_bloom, seed):
    """Three joiners that all first see an empty swarm (their records are not visible yet): each would take [0, 2);
    settling, they cover [0, 6)."""
    random.seed(seed)
    cfg = ServerConfig(model_dir=tiny_bloom, blocks=None, num_blocks=2, join_settle_s=0.2)
    model = model_spec(cfg)
    board, chosen = Board(delay_s=0.02), {}  # records land well within the shortest pause (0.1 s)
    start = threading.Barrier(3)

    def join(name: str) -> None:
        start.wait()  # all read the (empty) swarm at once
        me = ServerRecord(server_id=name, address="h:1", start=0, end=1, state=JOINING)
        chosen[name] = settle(cfg, model, me, board.fetch, board.announce)

    threads = [threading.Thread(target=join, args=(name,)) for name in ("x", "y", "z")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(b for r in chosen.values() for b in range(r.start, r.end)) == list(range(6)), chosen
    assert {r.state for r in board.records.values()} == {LOADING}  # every final choice announced as loading
    assert {n: BlockRange(r.start, r.end) for n, r in board.records.items()} == chosen


def test_without_settling_a_joiner_announces_its_first_choice_as_final(tiny_bloom):
    cfg = ServerConfig(model_dir=tiny_bloom, blocks=None, num_blocks=2, join_settle_s=0)
    board = Board()
    board.announce(rec("a", 0, 2))
    me = ServerRecord(server_id="m", address="h:1", start=0, end=1, state=JOINING)
    assert settle(cfg, model_spec(cfg), me, board.fetch, board.announce) == BlockRange(2, 4)
    assert dataclasses.replace(board.records["m"], joined_at=0.0) == ServerRecord(
        server_id="m", address="h:1", start=2, end=4, state=LOADING)


def test_a_given_range_is_announced_as_loading_before_it_loads(tiny_bloom):
    cfg = ServerConfig(model_dir=tiny_bloom, blocks=BlockRange(2, 5), port=4321)
    board = Board()
    assert choose_blocks(cfg, dht=None, dht_prefix="p", server_id="fixed", announce=board.announce) == BlockRange(2, 5)
    record = board.records["fixed"]
    assert (record.state, record.start, record.end, record.address) == (LOADING, 2, 5, "127.0.0.1:4321")


def loader(sid: str, start: int, end: int) -> ServerRecord:
    return ServerRecord(server_id=sid, address="127.0.0.1:1", start=start, end=end, state=LOADING)


def test_of_two_spares_loading_one_gap_the_larger_id_backs_off():
    a, b = loader("a" * 8, 3, 6), loader("b" * 8, 2, 5)  # both saw blocks 3-5 uncovered in the same check
    records = {r.server_id: r for r in (a, b, rec("c", 0, 3))}
    assert first_loader(b, records) == a  # b sees a's record: a goes on, b stays where it was
    assert first_loader(a, records) is None  # a sees b's: b yields, not a
    assert first_loader(loader("b" * 8, 6, 8), records) is None  # other blocks: both go on


def test_a_loader_that_never_serves_stops_keeping_spares_off_its_blocks():
    watch = LoadingWatch(limit_s=300.0)
    serving = rec("s", 0, 3)
    for sid, t in (("hostile-1", 0.0), ("hostile-2", 200.0)):  # announcing loading forever, under new ids
        records = watch.trusted({"s": serving, sid: loader(sid, 3, 6)}, 6, t)
        assert sid in records and uncovered(records, 6) == []  # a move may take minutes: trusted for now
    records = watch.trusted({"s": serving, "hostile-3": loader("hostile-3", 3, 6)}, 6, 301.0)
    assert set(records) == {"s"} and uncovered(records, 6) == [3, 4, 5]  # the blocks are a gap again
    assert first_loader(loader("z", 3, 6), watch.without_stale({"hostile-3": loader("hostile-3", 3, 6)}, 301.0)) \
        is None  # nor does one make a spare back off
    # a block served online meanwhile starts the clock afresh
    watch.trusted({"s": serving, "t": rec("t", 3, 6)}, 6, 302.0)
    assert "l" in watch.trusted({"s": serving, "l": loader("l", 3, 6)}, 6, 400.0)
