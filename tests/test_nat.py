"""Servers at home: behind a real NAT (network namespaces + an nftables masquerade, swarmlm/bench/netem/nat.py),
reached through a relay (swarm/relay.py, swarm/reach.py). The swarm is private, so strangers are tried too.

Layout: the root namespace is "the internet" (bootstrap A, relay R, the client); homes 0 and 1 each hold a server
behind its own router ([0, 3) and [3, 6) of tiny BLOOM: two NATed servers in a row, pushes between them go through
the relay); home 2 holds a tiny-Llama server whose only peer does not relay (--no-relay): it can never be reached."""
from __future__ import annotations

import socket
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from swarmlm.bench.netem.nat import NatTestbed, nat_unsupported_reason
from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.errors import MissingBlocks
from swarmlm.swarm.local import LocalSwarm
from swarmlm.swarm.private import create_swarm_key
from swarmlm.types import BlockRange
from tests.swarm_helpers import greedy_reference

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(nat_unsupported_reason() is not None, reason=f"{nat_unsupported_reason()}")]
PROMPT = "the quick brown fox jumps over"
FORWARDED = 43161  # home 3's router forwards this port to its host: a home server that is reachable


@dataclass
class Home:
    nat: NatTestbed
    bootstrap: list[str]  # A: the DHT (and a relay) the clients know
    relay: subprocess.Popen  # R: the relay the NATed servers use first
    relay_addr: str
    key: Path  # the private swarm's key file
    servers: list  # homes 0 and 1: BLOOM [0, 3) and [3, 6), relayed
    unrelayed: object  # home 2: Llama [0, 6), no relay takes it
    forwarded: object  # home 3: BLOOM [0, 6) under its own DHT prefix, port forwarded: direct


@pytest.fixture(scope="module")
def home(tiny_bloom, tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nat")
    key = tmp / "swarm.key"
    create_swarm_key(key)
    with NatTestbed(4, forward={3: FORWARDED}) as nat, LocalSwarm(tiny_bloom, log_dir=tmp / "logs", swarm_key_file=key) as swarm:
        swarm.start_dht(host=nat.public_ip)
        bootstrap = swarm.initial_peers
        relay, relay_addrs = swarm.spawn_dht("relay", nat.public_ip, ["--initial-peers", *bootstrap])
        swarm.initial_peers = relay_addrs + bootstrap  # the servers: relay R first, A when R is gone
        servers = [swarm.start_server(BlockRange(a, b), wait=False, prefix=nat.exec_prefix(i), host=nat.host_ip(i))
                   for i, (a, b) in enumerate([(0, 3), (3, 6)])]
        _, lone = swarm.spawn_dht("norelay", nat.public_ip, ["--no-relay", "--initial-peers", *bootstrap])
        swarm.initial_peers = lone
        swarm.model_dir = tiny_llama
        unrelayed = swarm.start_server(BlockRange(0, 6), wait=False, prefix=nat.exec_prefix(2), host=nat.host_ip(2))
        swarm.initial_peers = bootstrap
        forwarded = swarm.start_server(BlockRange(0, 6), wait=False, prefix=nat.exec_prefix(3), host="0.0.0.0",
                                       extra=["--port", str(FORWARDED), "--dht-prefix", "forwarded-home"])
        swarm.wait_ready(servers + [unrelayed, forwarded])
        yield Home(nat, bootstrap, relay, relay_addrs[0], key, servers, unrelayed, forwarded)


def _client(path, bootstrap, key, **kw):
    from swarmlm.swarm.private import load_swarm_key

    return DistributedModelForCausalLM.from_pretrained(path, initial_peers=bootstrap, swarm_key=load_swarm_key(key),
                                                       **kw)


def test_nothing_connects_in(home):
    nat = home.nat
    port = home.servers[0].ready["address"]  # p2p/<peer id>: what it announces is no IP address at all
    assert port.startswith("p2p/")
    with pytest.raises(OSError):  # its LAN is not routed here (no packet leaves: an unreachable route)
        socket.create_connection((nat.host_ip(0), 1), timeout=2)
    with pytest.raises(OSError):  # and its router forwards nothing in
        socket.create_connection((nat.router_ip(0), 22), timeout=2)


def test_a_home_with_a_forwarded_port_is_found_reachable(home):
    """The dial-back reaches it through its router: it announces the router's address (the one the relay saw),
    not its LAN address, and serves directly."""
    assert home.forwarded.ready["address"] == f"{home.nat.router_ip(3)}:{FORWARDED}"


def test_nated_servers_are_relayed_and_exact(home, tiny_bloom):
    bootstrap, relay_addr, key, servers = home.bootstrap, home.relay_addr, home.key, home.servers
    ids, want = greedy_reference(tiny_bloom, PROMPT, 12)
    for push in ("off", "on"):  # on: server 0 pushes to server 1 through the relay
        client = _client(tiny_bloom, bootstrap, key, push=push)
        try:
            got = client.generate(ids, max_new_tokens=12, min_new_tokens=12)
            assert got[0, ids.shape[1]:].tolist() == want
            records = client.remote.view.records
            assert {r.address for r in records.values()} == {s.ready["address"] for s in servers}
            assert all(r.relayed and r.relay == relay_addr for r in records.values())
            assert all(rtt > 0 for rtt in client.remote.view.rtt_s.values())  # measured through the relay
            if push == "on":
                _status_marks_relayed(client)
        finally:
            client.close()


def test_a_stranger_cannot_use_the_relay(home):
    from swarmlm.swarm.p2p_link import P2PNode
    from swarmlm.swarm.private import load_swarm_key
    from swarmlm.swarm.reach import Tunnels
    from tests.swarm_helpers import stub
    from swarmlm.wire import swarm_pb2 as pb

    relay_addr, key = home.relay_addr, home.key
    address = home.servers[0].ready["address"]
    node = P2PNode()
    try:
        for swarm_key, allowed in ((None, False), (b"0" * 32, False), (load_swarm_key(key), True)):
            tunnels = Tunnels(node.p2p, node.loop, swarm_key)
            tunnels.add(address, relay_addr)
            try:
                if allowed:  # the relay lets a member through (its gRPC call then needs the key too: not sent here)
                    with pytest.raises(Exception, match="UNAUTHENTICATED|private swarm"):
                        stub(address).Info(pb.InfoRequest(), timeout=10)
                    assert address not in tunnels.failures
                else:
                    with pytest.raises(Exception):
                        stub(address).Info(pb.InfoRequest(), timeout=10)
                    assert "private swarm" in tunnels.failures[address]
            finally:
                tunnels.close()
    finally:
        node.shutdown()


def test_unrelayable_server_is_never_routed_and_the_error_says_why(home, tiny_llama):
    assert home.unrelayed.ready["address"].startswith("p2p/")
    client = _client(tiny_llama, home.bootstrap, home.key, wait_for_blocks_s=2.0)
    try:
        with pytest.raises(MissingBlocks, match="behind NAT and no relay takes it"):
            client.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2)
    finally:
        client.close()


def test_relay_killed_mid_generation_fails_over_exactly(home, tiny_bloom):
    bootstrap, relay = home.bootstrap, home.relay
    ids, want = greedy_reference(tiny_bloom, PROMPT, 24)
    client = _client(tiny_bloom, bootstrap, home.key, push="on")
    killed = threading.Event()

    class KillRelay:  # a transformers streamer: after a few tokens, the relay dies (the servers move to A)
        n = 0

        def put(self, value):
            self.n += 1
            if self.n == 6:
                relay.kill()
                relay.wait(10)
                killed.set()

        def end(self):
            pass

    try:
        got = client.generate(ids, max_new_tokens=24, min_new_tokens=24, streamer=KillRelay())
        assert killed.is_set() and got[0, ids.shape[1]:].tolist() == want
        assert sum(step.failovers for step in client.last_stats.steps) >= 1
        assert all(r.relay in bootstrap for r in client.remote.view.records.values())  # moved on to A
    finally:
        client.close()


def _status_marks_relayed(client) -> None:
    """`swarmlm status` and the monitor's data (/v1/swarm) mark relayed servers, asked live through the relay."""
    import io

    from swarmlm.api.swarm_view import SwarmWatcher
    from swarmlm.cli.status_cmd import render, table_console

    view = SwarmWatcher(client.remote).read()
    assert [s["state"] for s in view["servers"]] == ["online", "online"]  # (Info answered through the relay)
    assert all(s["relayed"] and s["relay"] for s in view["servers"])
    out = io.StringIO()
    assert render(view, "tiny-bloom", table_console(out)) == 0
    assert out.getvalue().count("(relayed)") == 2


def test_a_leftover_lan_route_is_not_taken_again():
    """A killed run leaves its LAN's unreachable route behind (no namespace names it): the next testbed picks
    another /24 instead of failing on `File exists`."""
    from swarmlm.bench.netem.netns import _free_subnet

    planted = str(_free_subnet())
    subprocess.run(["ip", "route", "add", "unreachable", planted], check=True)
    try:
        with NatTestbed(1) as nat:
            assert str(nat.lan) != planted and str(nat.wan) != planted
    finally:
        subprocess.run(["ip", "route", "del", "unreachable", planted], check=True)
