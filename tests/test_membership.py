"""Honest, living membership: signed records, fast expiry, servers that place and re-place themselves."""
from __future__ import annotations

import dataclasses
import signal
import time

import pytest
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey

from swarmlm.model.random_checkpoint import init_checkpoint
from swarmlm.swarm.dht import announce, default_dht_prefix, fetch_records, owner_subkey, visible_addrs
from swarmlm.swarm.dht_thread import ThreadDHT
from swarmlm.swarm.identity import Identity
from swarmlm.swarm.local import LocalSwarm
from swarmlm.swarm.records import JOINING, LOADING, ONLINE, ServerRecord
from swarmlm.types import BlockRange
from tests.swarm_helpers import client_of, even_out_view, server_processes


def test_forged_and_unsigned_records_are_rejected():
    # every node in this process (ThreadDHT): forking hivemind's DHT beside the client's live gRPC threads of earlier
    # tests can crash the child (a segfault seen on a busy machine)
    boot = ThreadDHT(client_mode=False)
    peers = visible_addrs(boot)
    owner_key = Identity.generate()  # a server id is its key's (swarm/identity.py)
    owner, srv_a = owner_key.validator, owner_key.server_id
    honest = ThreadDHT(peers, client_mode=False, validator=owner)
    attacker = ThreadDHT(peers, client_mode=False, validator=RSASignatureValidator(RSAPrivateKey()))
    reader = ThreadDHT(peers, client_mode=True)  # what clients run: a node in this process, no fork
    try:
        real = ServerRecord(server_id=srv_a, address="127.0.0.1:5000", start=0, end=2, decode_s=0.01)
        assert announce(honest, "m", real, 30, subkey=owner_subkey(srv_a, owner))
        # the attacker overwrites srvA's record with a newer one pointing elsewhere: its signature does not match
        forged = ServerRecord(server_id=srv_a, address="127.0.0.2:6666", start=0, end=2, decode_s=1e-9)
        assert not announce(attacker, "m", forged, 60, subkey=owner_subkey(srv_a, owner))
        # an unsigned record is stored by the DHT but ignored by readers
        announce(attacker, "m", ServerRecord(server_id="srvB", address="127.0.0.2:6666", start=0, end=2), 60,
                 subkey="srvB")
        # a record signed by the attacker's own key cannot claim another server's id either
        announce(attacker, "m", ServerRecord(server_id=srv_a, address="127.0.0.2:1", start=0, end=2), 60,
                 subkey="srvC" + owner_subkey("", RSASignatureValidator(RSAPrivateKey())))
        seen = fetch_records(reader, "m", range(2))
        assert set(seen) == {srv_a} and seen[srv_a].address == "127.0.0.1:5000"
    finally:
        for d in (boot, honest, attacker, reader):
            d.shutdown()


def test_in_process_dht_stores_reads_and_leaves_no_daemon():
    """A client's ThreadDHT is a full node (it can announce, too) and its shutdown stops its p2pd daemon."""
    import psutil

    def daemons() -> set[int]:  # direct children: boot's daemon is a child of boot's forked process
        return {c.pid for c in psutil.Process().children() if "p2pd" in c.name()}

    before = daemons()
    boot = ThreadDHT(client_mode=False)  # in-process too (no fork beside earlier tests' gRPC threads)
    node = ThreadDHT(visible_addrs(boot), client_mode=False)
    try:
        assert len(daemons() - before) == 2  # boot's and the node's own daemons
        me = Identity(RSAPrivateKey.process_wide())  # the node's default signing key
        record = ServerRecord(server_id=me.server_id, address="127.0.0.1:5001", start=0, end=3)
        assert announce(node, "t", record, 30)
        assert fetch_records(node, "t", range(3))[me.server_id] == record
    finally:
        node.shutdown()
        node.shutdown()  # twice is harmless
        boot.shutdown()
    deadline = time.time() + 60
    while daemons() - before and time.time() < deadline:
        time.sleep(0.1)
    assert not daemons() - before


def test_a_node_whose_peers_all_stopped_answering_rejoins_through_its_initial_peers():
    """hivemind drops a peer after one unanswered request and bootstraps only at start: a reader (what a gateway
    runs) whose bootstrap node stalled while its only server died read nothing new for good (the hour soak's gateway:
    every request a 503 from minute 24). It must ping its initial peers again and find the server that came next."""
    import threading

    boot = ThreadDHT(client_mode=False)
    peers = visible_addrs(boot)
    first, second = Identity.generate(), Identity.generate()
    server = ThreadDHT(peers, client_mode=False, validator=first.validator)
    reader = ThreadDHT(peers, client_mode=True)
    release = threading.Event()
    try:
        old = ServerRecord(server_id=first.server_id, address="127.0.0.1:5003", start=0, end=2)
        assert announce(server, "r", old, 60, subkey=owner_subkey(first.server_id, first.validator))
        assert first.server_id in fetch_records(reader, "r", range(2))
        server.shutdown()  # the server dies, and the bootstrap node hangs (its loop blocked, like SIGSTOP)
        boot.loop.call_soon_threadsafe(release.wait, 120)
        fetch_records(reader, "r", range(2))  # no one answers: the reader's table empties
        deadline = time.time() + 60
        while reader.peers_known() and time.time() < deadline:
            time.sleep(0.1)
        assert reader.peers_known() == 0
        release.set()  # the bootstrap node is back, and a new server joins through it
        server = ThreadDHT(peers, client_mode=False, validator=second.validator)
        new = ServerRecord(server_id=second.server_id, address="127.0.0.1:5004", start=0, end=2)
        assert announce(server, "r", new, 60, subkey=owner_subkey(second.server_id, second.validator))
        deadline = time.time() + 90
        while second.server_id not in fetch_records(reader, "r", range(2)) and time.time() < deadline:
            time.sleep(0.5)
        assert fetch_records(reader, "r", range(2)).get(second.server_id) == new
        assert reader.rejoins >= 1 and reader.peers_known() >= 1
    finally:
        release.set()
        for d in (reader, server, boot):
            d.shutdown()


def test_joining_and_loading_records_are_seen_by_placement_only():
    """A server placing itself announces its range before it serves: clients (and push targets) never see it."""
    boot = ThreadDHT(client_mode=False)
    node = ThreadDHT(visible_addrs(boot), client_mode=False)
    try:
        me = Identity(RSAPrivateKey.process_wide())  # the node's default signing key
        joining = ServerRecord(server_id=me.server_id, address="127.0.0.1:0", start=0, end=3, state=JOINING,
                               joined_at=time.time())
        assert announce(node, "j", joining, 30)
        assert fetch_records(node, "j", range(3)) == {}
        assert fetch_records(node, "j", range(3), joining=True) == {me.server_id: joining}
        loading = dataclasses.replace(joining, start=1, end=3, state=LOADING)
        assert announce(node, "j", loading, 31)  # its newest record wins, on every block it was announced on
        assert fetch_records(node, "j", range(3), joining=True) == {me.server_id: loading}
        online = dataclasses.replace(loading, address="127.0.0.1:5002", state=ONLINE)
        assert announce(node, "j", online, 32)
        assert fetch_records(node, "j", range(3)) == {me.server_id: online}
        with pytest.raises(ValueError, match="state"):
            ServerRecord.from_dict({**online.to_dict(), "state": "serving-soon"})
    finally:
        node.shutdown()
        boot.shutdown()


@pytest.mark.slow
def test_dead_server_leaves_routes_within_seconds(tiny_bloom):
    with server_processes(tiny_bloom, [BlockRange(0, 6), BlockRange(0, 6)]) as swarm:
        reader = ThreadDHT(swarm.initial_peers, client_mode=True)  # what clients run (no fork)
        dht_prefix = default_dht_prefix(tiny_bloom)
        try:
            assert len(fetch_records(reader, dht_prefix, range(6))) == 2
            victim = swarm.servers[0]
            swarm.kill(victim, signal.SIGKILL)
            # the record lives 8 s after its last refresh; 40 s leaves a busy machine room (a record that never
            # expires, or lives as long as the 60 s cap, still fails)
            _until_gone(reader, dht_prefix, victim.server_id, 40, "a dead server's record outlived its TTL")
            # a clean shutdown withdraws the record (an offline record), then the process exits cleanly
            other = swarm.servers[1]
            swarm.kill(other, signal.SIGTERM)
            _until_gone(reader, dht_prefix, other.server_id, 40, "SIGTERM did not withdraw the record")
            assert other.proc.wait(60) == 0
            assert "withdrawal failed" not in other.log_path.read_text()
        finally:
            reader.shutdown()


def _until_gone(reader, dht_prefix: str, server_id: str, timeout_s: float, message: str) -> None:
    deadline = time.monotonic() + timeout_s
    while server_id in fetch_records(reader, dht_prefix, range(6)):
        assert time.monotonic() < deadline, message
        time.sleep(0.1)


def _until_seen(reader, path: str, count: int, num_blocks: int, timeout_s: float = 60.0) -> None:
    """Poll the DHT (instead of sleeping a guessed time) until `count` servers' records are visible."""
    deadline = time.monotonic() + timeout_s
    while len(records := fetch_records(reader, default_dht_prefix(path), range(num_blocks))) < count:
        assert time.monotonic() < deadline, f"only {len(records)} of {count} servers visible in the DHT"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def bloom24(tmp_path_factory) -> str:
    return str(init_checkpoint("tiny-bloom", tmp_path_factory.mktemp("bloom24"), seed=3, num_layers=24))


@pytest.mark.slow
def test_servers_without_ranges_fill_the_least_covered_blocks(bloom24):
    with LocalSwarm(bloom24) as swarm:
        swarm.start_dht()
        reader = ThreadDHT(swarm.initial_peers, client_mode=True)
        ranges = []
        try:
            for i in range(3):  # one after another, each sees the ones before it in the DHT
                server = swarm.start_server(None, extra=["--num-blocks", "8"])
                ranges.append(tuple(server.ready["blocks"]))
                _until_seen(reader, bloom24, i + 1, 24)
        finally:
            reader.shutdown()
        covered = sorted(b for s, e in ranges for b in range(s, e))
        assert covered == list(range(24)), ranges


@pytest.mark.slow
def test_servers_started_together_leave_no_hole(bloom24):
    """Started at the same moment, none sees the others' records when it first chooses: each announces its choice as
    joining before loading and re-checks it against the servers that joined before it (server/placement.py).
    No rebalancing (--rebalance-period 0): the ranges they load at once cover the model."""
    with LocalSwarm(bloom24) as swarm:
        swarm.start_dht()
        servers = [swarm.start_server(None, extra=["--num-blocks", "8", "--rebalance-period", "0"], wait=False)
                   for _ in range(3)]
        swarm.wait_ready(servers)
        ranges = [tuple(s.ready["blocks"]) for s in servers]
        covered = sorted(b for s, e in ranges for b in range(s, e))
        assert covered == list(range(24)), ranges


@pytest.mark.slow
def test_rebalancing_covers_blocks_a_dead_server_left(tiny_bloom):
    with LocalSwarm(tiny_bloom) as swarm:
        swarm.start_dht()
        swarm.start_server(BlockRange(0, 3))
        lost = swarm.start_server(BlockRange(3, 6))
        reader = ThreadDHT(swarm.initial_peers, client_mode=True)
        try:
            _until_seen(reader, tiny_bloom, 2, 6)
            mover = swarm.start_server(None, extra=["--num-blocks", "3", "--rebalance-period", "1"])
            assert mover.ready["blocks"] == [0, 3]  # blocks 3-5 were covered, ties go to the first window
            swarm.kill(lost, signal.SIGKILL)
            deadline = time.time() + 120  # the lost record expires (8 s), then a rebalancing check (every 1 s)
            while True:
                records = fetch_records(reader, default_dht_prefix(tiny_bloom), range(6))
                if records.get(mover.server_id) and records[mover.server_id].start == 3:
                    break
                assert time.time() < deadline, f"the server did not move: {records}"
                time.sleep(0.5)
        finally:
            reader.shutdown()
        client = client_of(swarm)
        out = client.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3)
        assert out.shape == (1, 6)
        client.close()


@pytest.mark.slow
def test_concurrent_sessions_spread_over_replicas(tiny_bloom):
    with LocalSwarm(tiny_bloom) as swarm:
        # one after the other: the second server reads the profile the first measured (the cache key includes the
        # checkpoint path, new per test run), so both announce the same speed and load alone decides the split
        swarm.start_dht()
        swarm.start_server(BlockRange(0, 6))
        swarm.start_server(BlockRange(0, 6))
        # a still view once both are seen (no re-read between the sessions), evened out: load alone decides
        client = client_of(swarm, records_max_age_s=600.0)
        deadline = time.monotonic() + 120
        while len(client.remote.view.usable()) < 2:  # either server alone covers the model: wait to see both
            assert time.monotonic() < deadline, "the second replica never appeared in the DHT"
            time.sleep(0.5)
            client.remote.refresh()
        even_out_view(client)
        sessions = [client.inference_session(max_length=32).open() for _ in range(4)]
        used = [s.route_spans()[0].server_id for s in sessions]
        rtts = dict(client.remote.view.rtt_s)
        for s in sessions:
            s.close()
        client.close()
    assert sorted(used.count(sid) for sid in set(used)) == [2, 2], (used, rtts)
