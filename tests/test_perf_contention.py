"""Compute contention in the one performance model: f(b), how a server's decode step grows with the sessions it
runs, measured by the server's profile, announced in Info / records, read back by the client and topology files."""
from __future__ import annotations

import random

import pytest

from swarmlm.client.router import profile_of
from swarmlm.errors import PlanningError
from swarmlm.perf.model import CONTENTION_ROWS, ComputeProfile, Network, PerfModel
from swarmlm.perf.profile import measure
from swarmlm.planner.topology import parse_topology
from swarmlm.server.stage import Stage
from swarmlm.swarm.records import ServerRecord, record_from_info
from swarmlm.types import BlockRange
from swarmlm.wire import swarm_pb2 as pb

# tau = 10 ms; one forward of 4 rows costs 25 ms (f(4) = 2.5), of 16 rows 40 ms (f(16) = 4)
MEASURED = ComputeProfile(0.0, 0.0, 0.010, 0.025, 0.040)


def test_unmeasured_profile_has_no_contention():
    p = ComputeProfile(0.001, 0.02, 0.010)
    assert not p.contended
    assert [p.load_factor(b) for b in (0, 1, 2, 16, 100)] == [1.0] * 5


def test_load_factor_runs_through_the_measured_rows():
    p = MEASURED
    assert p.contended and CONTENTION_ROWS == (4, 16)
    assert p.load_factor(1) == 1.0
    assert p.load_factor(4) == pytest.approx(2.5)
    assert p.load_factor(16) == pytest.approx(4.0)
    assert p.load_factor(2) == pytest.approx(1.5)  # 1 + (2.5 - 1) / 3
    assert p.load_factor(10) == pytest.approx(3.25)  # 2.5 + (4 - 2.5) * 6 / 12
    assert p.load_factor(28) == pytest.approx(5.5)  # past 16: the last segment's slope, 0.125 per session


def test_noisy_measurements_are_clamped():
    # a busy host measured 4 rows faster than 1 and 16 faster than 4: more sessions never cost less
    p = ComputeProfile(0.0, 0.0, 0.010, 0.008, 0.006)
    assert [p.load_factor(b) for b in (1, 2, 4, 16, 40)] == [1.0] * 5
    # 16 rows measured at 40x one row: never worse than no batching at all, f(b) <= b
    q = ComputeProfile(0.0, 0.0, 0.010, 0.080, 0.400)
    assert q.load_factor(4) == 4.0 and q.load_factor(16) == 16.0 and q.load_factor(3) == 3.0


@pytest.mark.parametrize("seed", range(20))
def test_load_factor_is_non_decreasing_and_bounded(seed):
    rng = random.Random(seed)
    tau = rng.uniform(1e-4, 1e-2)
    p = ComputeProfile(0.0, 0.0, tau, tau * rng.uniform(0.2, 6.0), tau * rng.uniform(0.2, 25.0))
    values = [p.load_factor(b) for b in range(1, 64)]
    assert values[0] == 1.0
    assert all(a <= b + 1e-12 for a, b in zip(values, values[1:]))
    assert all(1.0 <= v <= b for b, v in enumerate(values, start=1))


def test_no_batching_bound_is_processor_sharing():
    p = ComputeProfile.no_batching(0.0, 0.01, 0.004)
    assert [p.load_factor(b) for b in range(1, 40)] == pytest.approx(list(range(1, 40)))


def test_both_rows_or_neither():
    with pytest.raises(ValueError, match="measured together"):
        ComputeProfile(0.0, 0.0, 0.01, 0.02, 0.0)
    with pytest.raises(ValueError, match="decode_16rows_s"):
        ComputeProfile(0.0, 0.0, 0.01, 0.02, -1.0)


def test_hop_times_grow_with_the_servers_sessions():
    net = Network()
    net.set_link("c", "s", 0.004)
    perf = PerfModel({"s": ComputeProfile(0.001, 0.002, 0.010, 0.025, 0.040)}, net, message_overhead_s=0.001)
    # a hop: RTT 0.004 + its messages' own cost 0.001 + blocks x compute x f(sessions)
    assert perf.decode_hop_s("c", "s", 3) == pytest.approx(0.005 + 3 * 0.010)
    assert perf.decode_hop_s("c", "s", 3, sessions=4) == pytest.approx(0.005 + 3 * 0.010 * 2.5)
    assert perf.prefill_hop_s("c", "s", 3, 10, sessions=16) == pytest.approx(0.005 + 3 * 0.012 * 4.0)
    assert perf.load_factor("s", 2) == pytest.approx(1.5)
    # the BPRR edge weight stays the one-session cost: routers apply the load factor themselves
    assert perf.hop_cost_terms("c", "s", 10, 5) == pytest.approx((5 * 0.005, 0.012 + 4 * 0.010))


def test_a_real_stage_profile_measures_the_batched_rows(tiny_bloom):
    stage = Stage(tiny_bloom, BlockRange(0, 2), "float32")
    p = measure(stage, decode_steps=2, repeats=1)
    assert p.decode_s > 0 and p.decode_4rows_s > 0 and p.decode_16rows_s > 0 and p.contended
    assert 1.0 <= p.load_factor(4) <= p.load_factor(16) <= 16.0


def _info(**kw) -> pb.InfoReply:
    base = dict(server_id="QmServer", start_block=0, end_block=4, decode_s_per_block=0.01, prefill_a_s=0.0,
                prefill_b_s=0.02)
    return pb.InfoReply(**{**base, **kw})


def test_info_and_records_carry_the_contention_and_the_client_reads_it():
    record = record_from_info(_info(decode_4rows_s_per_block=0.025, decode_16rows_s_per_block=0.04), "127.0.0.1:1")
    assert (record.decode_4rows_s, record.decode_16rows_s) == (0.025, 0.04)
    assert len(str(record.to_dict())) < 2000  # records stay far below hivemind's 16 KB
    assert ServerRecord.from_dict(record.to_dict()) == record
    assert profile_of(record).load_factor(4) == pytest.approx(2.5)
    with pytest.raises(ValueError, match="negative"):
        ServerRecord.from_dict({**record.to_dict(), "decode_16rows_s": -0.1})
    # a server that announces no contention (an older one): the client assumes no batching gain, f(b) = b
    old = record_from_info(_info(), "127.0.0.1:1")
    assert old.decode_4rows_s == 0.0 and profile_of(old).load_factor(3) == pytest.approx(3.0)


def _topology(server: dict) -> dict:
    return {"model": {"num_blocks": 2, "block_bytes": 1e6, "cache_bytes_per_session_block": 1e6},
            "servers": [{"name": "s", "memory_bytes": 1e9, "tau_prefill_s": [0.0, 0.01], "tau_decode_s": 0.01,
                         **server}],
            "clients": [{"name": "c"}], "rtt_s": {"c": {"s": 0.01}},
            "workload": {"input_tokens": 4, "output_tokens": 4, "concurrency": 1}}


def test_topology_files_declare_the_contention():
    topo = parse_topology(_topology({"tau_decode_rows_s": [0.025, 0.04]}))
    assert topo.servers[0].profile.load_factor(16) == pytest.approx(4.0)
    assert not parse_topology(_topology({})).servers[0].profile.contended
    for bad in ([0.025], [0.025, 0.0], "fast", [0.025, "x"]):
        with pytest.raises(PlanningError, match="tau_decode_rows_s"):
            parse_topology(_topology({"tau_decode_rows_s": bad}))
