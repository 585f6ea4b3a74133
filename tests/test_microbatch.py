"""MoLink's micro-batch rule: few requests, fast and slow links, the cap, and the helpers' units."""
from __future__ import annotations

import pytest

from swarmlm.bench.microbatch import choose_num_microbatches, decode_time_fn, transfer_time_fn


def test_one_or_two_requests():
    for n, want in [(0, 1), (1, 1), (2, 2)]:
        assert choose_num_microbatches(n, lambda b: 1.0, lambda b: 100.0) == want


def test_fast_link_needs_only_three():
    # compute 20 ms, transfer ~0: (3 - 2) * 25 ms >= 2 * 5 ms at once
    assert choose_num_microbatches(30, lambda b: 0.020, lambda b: 0.0) == 3


def test_slow_link_needs_more_until_the_inequality_holds():
    comp, trans = (lambda b: 0.010), (lambda b: 0.030)
    b = choose_num_microbatches(100, comp, trans)
    # (b - 2) * 15 ms >= 2 * 35 ms  ->  b - 2 >= 4.67  ->  b = 7, and 6 does not satisfy it
    assert b == 7
    assert (b - 2) * 0.015 >= 2 * 0.035 and (b - 3) * 0.015 < 2 * 0.035


def test_sizes_follow_n_over_b():
    seen: list[int] = []

    def comp(batch: int) -> float:
        seen.append(batch)
        return 0.001

    choose_num_microbatches(20, comp, lambda b: 1.0, max_b=5)
    assert seen == [7, 5, 4]  # ceil(20 / 3), ceil(20 / 4), ceil(20 / 5)


def test_never_satisfied_gives_the_cap():
    assert choose_num_microbatches(50, lambda b: 0.001, lambda b: 10.0) == 10
    assert choose_num_microbatches(50, lambda b: 0.001, lambda b: 10.0, max_b=6) == 6
    with pytest.raises(ValueError):
        choose_num_microbatches(50, lambda b: 0.001, lambda b: 0.001, max_b=2)


def test_load_changes_the_answer():
    # a per-sequence decode cost: with more requests each micro-batch computes longer, so fewer are needed
    comp = decode_time_fn(decode_s_per_block=1e-3, blocks=4, per_sequence_s=5e-3)
    trans = transfer_time_fn(hidden_size=4096, bytes_per_value=2, bandwidth_bps=10e6)
    light, heavy = choose_num_microbatches(6, comp, trans), choose_num_microbatches(60, comp, trans)
    assert (light, heavy) == (4, 3)


def test_helper_units():
    trans = transfer_time_fn(hidden_size=1024, bytes_per_value=4, bandwidth_bps=100e6, rtt_s=0.01)
    assert trans(2) == pytest.approx(2 * 1024 * 4 * 8 / 100e6 + 0.01)
    assert decode_time_fn(0.002, 3)(5) == pytest.approx(0.006)
    with pytest.raises(ValueError):
        transfer_time_fn(64, 4, 0.0)


# ---- the rule fed by measurements ------------------------------------------------------------------------------

from types import SimpleNamespace  # noqa: E402

from swarmlm.bench.microbatch import MicroBatchPlanner  # noqa: E402


def _step(compute_s: float, network_s: float, n_tokens: int = 1):
    hop = SimpleNamespace(compute_s=compute_s, network_s=network_s)
    return SimpleNamespace(n_tokens=n_tokens, hops=[hop, SimpleNamespace(compute_s=compute_s / 2, network_s=0.0)],
                           failovers=0)


def test_planner_falls_back_until_it_has_measured_a_decode_step():
    planner = MicroBatchPlanner(bytes_per_row=4096, profile_decode_s=0.01, bandwidth_bps=lambda: 1e9)
    assert planner.choose(8, fallback=3) == 3 and planner.choose(2, fallback=3) == 2
    planner.observe(2, [_step(0.02, 0.001, n_tokens=40)])  # a prefill teaches nothing about decode
    assert not planner.samples


def test_planner_fits_compute_per_batch_size_from_the_slowest_hop():
    planner = MicroBatchPlanner(bytes_per_row=4096, profile_decode_s=0.010, bandwidth_bps=lambda: 1e9)
    planner.observe(4, [_step(0.016, 0.002)] * 5)  # slowest hop: 16 ms at 4 rows; profile: 10 ms at 1 row
    assert planner.decode_time(1) == pytest.approx(0.010, rel=0.05)
    assert planner.decode_time(4) == pytest.approx(0.016, rel=0.05)
    assert planner.decode_time(7) == pytest.approx(0.022, rel=0.05)  # 2 ms per added row
    assert planner.transfer_time(4) == pytest.approx(0.002)
    assert planner.transfer_time(5) == pytest.approx(0.002 + 4096 * 8 / 1e9)


def test_planner_splits_finer_when_the_measured_link_is_slow():
    fast = MicroBatchPlanner(bytes_per_row=4096, profile_decode_s=0.02, bandwidth_bps=lambda: 1e9)
    slow = MicroBatchPlanner(bytes_per_row=4096, profile_decode_s=0.02, bandwidth_bps=lambda: 1e9)
    fast.observe(2, [_step(0.03, 0.001)] * 3)
    slow.observe(2, [_step(0.03, 0.060)] * 3)  # 60 ms on the wire per step: more micro-batches cover it
    b_fast, b_slow = fast.choose(24, fallback=2), slow.choose(24, fallback=2)
    assert b_fast == 3 and b_slow > b_fast
    assert slow.decisions[-1]["t_trans_s"] == pytest.approx(0.060, rel=0.01)
