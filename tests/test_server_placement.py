"""A server without --blocks asks the planner, with the swarm's announced records, where to go."""
from __future__ import annotations

from swarmlm.config import ServerConfig
from swarmlm.server.placement import block_throughput, choose_blocks_from, model_spec, should_move
from swarmlm.swarm.records import ServerRecord
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
