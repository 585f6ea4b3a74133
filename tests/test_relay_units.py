"""Servers behind NAT, the parts without servers: records, push targets, relay addresses, header lines, the
channel registry, connect-check channels, the dial-back's port (swarm/records.py, server/push.py, swarm/p2p_link.py,
wire/channel.py, server/network.py)."""
from __future__ import annotations

import asyncio

import pytest

from swarmlm.errors import InvalidRequest
from swarmlm.server.push import check_targets
from swarmlm.swarm.p2p_link import LinkError, header, loopback_for, parse_relay_addr, read_header
from swarmlm.swarm.records import ServerRecord
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire.channel import _target, forget_p2p_endpoint, register_p2p_endpoint

PEER = "12D3KooWEat3ikUs8zTc2MPTy4pS4Q7UzYS5Micm32susyPnHjJX"
RELAY = f"/ip4/10.213.0.1/tcp/4001/p2p/{PEER}"


def _record(**kw) -> dict:
    return {"server_id": "Qm1", "address": f"p2p/{PEER}", "start": 0, "end": 2, **kw}


def test_a_relayed_record_carries_its_peer_id_and_relay():
    r = ServerRecord.from_dict(_record(relay=RELAY))
    assert r.relayed and r.relay == RELAY
    assert ServerRecord.from_dict(_record()).relayed  # no relay takes it: still relayed, and unreachable
    assert not ServerRecord.from_dict(_record(address="10.0.0.1:5")).relayed


@pytest.mark.parametrize("bad", [
    _record(address="10.0.0.1:5", relay=RELAY),  # a relay but a direct address
    _record(relay="/ip4/10.0.0.1/tcp/1"),  # no peer id
    _record(relay="/ip4/999.0.0.1/tcp/1/p2p/" + PEER),
    _record(relay="/dns/evil.example/tcp/1/p2p/" + PEER),
    _record(address="p2p/../etc"),
    _record(address="p2p/" + "Q" * 80),
])
def test_malformed_relayed_records_are_refused(bad):
    with pytest.raises(ValueError):
        ServerRecord.from_dict(bad)


def test_push_targets_may_be_p2p_addresses():
    good = pb.PushTarget(address=f"p2p/{PEER}", session_id="ab", step_id=1, secret=b"x" * 16)
    check_targets([good])
    for bad in ("p2p/../x", "p2p/", f"p2p/{PEER}:1", "p2p/" + "1" * 70):
        with pytest.raises(InvalidRequest, match="p2p/<peer id>"):
            check_targets([pb.PushTarget(address=bad, session_id="ab", step_id=1, secret=b"x" * 16)])


def test_relay_addresses_split_into_transport_and_peer():
    maddr, peer = parse_relay_addr(RELAY)
    assert str(maddr) == "/ip4/10.213.0.1/tcp/4001" and peer.to_base58() == PEER
    for bad in ("", "/ip4/1.2.3.4/tcp/0/p2p/" + PEER, "/ip4/1.2.3.4/tcp/1/p2p/xyz", RELAY + "/p2p-circuit"):
        with pytest.raises(ValueError):
            parse_relay_addr(bad)


def test_loopback_sources_differ_per_peer():
    a, b = loopback_for(PEER), loopback_for(PEER[:-1] + "Y")
    assert a.startswith("127.") and a != b and a == loopback_for(PEER)


def _read(data: bytes, eof: bool = True, timeout_s: float = 0.2) -> list[str]:
    async def go():
        reader = asyncio.StreamReader(limit=1 << 16)
        reader.feed_data(data)
        if eof:
            reader.feed_eof()
        return await read_header(reader, timeout_s)
    return asyncio.run(go())


def test_header_lines_are_bounded_and_checked():
    assert _read(header("DIAL", PEER, "-")) == ["DIAL", PEER, "-"]
    for data, why in ((b"A" * 600 + b"\n", "too long"), (b"\xff\n", "not ASCII"), (b"a  b\n", "malformed"),
                      (b"", "ended before"), (b"DIAL", "cut short")):
        with pytest.raises(LinkError, match=why):
            _read(data)
    with pytest.raises(LinkError, match="in time"):
        _read(b"DIAL x", eof=False)


def test_channels_to_p2p_addresses_go_where_their_tunnel_says():
    address = f"p2p/{PEER}"
    assert _target(address).startswith("unix:/nonexistent")  # no route: calls fail UNAVAILABLE, as a dead server's
    first, second = (lambda a: "127.0.0.1:1"), (lambda a: "127.0.0.1:2")
    register_p2p_endpoint(address, first)
    register_p2p_endpoint(address, second)
    forget_p2p_endpoint(address, first)  # replaced since: kept
    assert _target(address) == "127.0.0.1:2"
    forget_p2p_endpoint(address, second)
    assert _target(address).startswith("unix:/nonexistent") and _target("10.0.0.1:5") == "10.0.0.1:5"


def test_circuits_are_capped_per_server_per_dialer_and_per_host():
    from swarmlm.swarm.relay import RelayLimits, circuit_refusal

    lim = RelayLimits(max_circuits_per_server=6, max_circuits_per_dialer=2, max_circuits_per_host=4, max_circuits=8)
    open_now = {"S": [("a", "10.0.0.1"), ("a", "10.0.0.1")]}
    assert "from_this_peer" in circuit_refusal(open_now, "S", ("a", "10.0.0.2"), lim).replace(" ", "_")
    assert circuit_refusal(open_now, "S", ("b", "10.0.0.1"), lim) is None
    open_now["S"] += [("b", "10.0.0.1"), ("c", "10.0.0.1")]  # 4 from one host (fresh peer ids are free)
    assert circuit_refusal(open_now, "S", ("d", "10.0.0.1"), lim).endswith("from this host")
    assert circuit_refusal(open_now, "S", ("d", "10.0.0.9"), lim) is None  # another host still gets in
    relayed = {"S": [(p, "relayed") for p in "wxyz"]}  # dialers at no IPv4 address share one host's quota
    assert circuit_refusal(relayed, "S", ("v", "relayed"), lim).endswith("from this host")
    everywhere = {"S": [("a", "1")], "T": [(p, h) for p, h in zip("bcdefgh", "2345678")]}  # 8 in all
    assert circuit_refusal(everywhere, "S", ("z", "9"), lim) == "too many relayed connections"


def test_a_fresh_channel_reaches_what_its_address_reaches_now(tiny_llama):
    """A connect check's channel (aio_channel fresh=True, server/network.py) connects now, whatever other channels to
    the same address hold (gRPC shares connections between them; a push's channel stays open): after a call through a
    dead relay failed, a check through a live one reaches the server (the shared connection, in its backoff, failed
    it UNAVAILABLE at once: an honest server lost its address to a stranger's record naming a dead relay), and after
    a call reached the server, a check through a dead relay fails (it never rides the earlier connection)."""
    import grpc

    from swarmlm.swarm.p2p_link import close, splice
    from swarmlm.types import BlockRange
    from swarmlm.wire import swarm_pb2_grpc as pb_grpc
    from swarmlm.wire.channel import aio_channel
    from tests.swarm_helpers import in_process_server

    async def reaches(channel, wait: bool = False) -> bool:
        try:
            await pb_grpc.SwarmStub(channel).Info(pb.InfoRequest(), timeout=30, wait_for_ready=wait)
            return True
        except grpc.aio.AioRpcError:
            return False

    async def checks(server_port: int) -> list[tuple[bool, bool]]:
        relay_alive = [False]

        async def tunnel(reader, writer) -> None:  # a local port relayed to the server, or not (a dead relay)
            if not relay_alive[0]:
                close(writer)
                return
            await splice((reader, writer), await asyncio.open_connection("127.0.0.1", server_port))

        tunnel_server = await asyncio.start_server(tunnel, "127.0.0.1", 0)
        address = f"127.0.0.1:{tunnel_server.sockets[0].getsockname()[1]}"
        other = aio_channel(address)  # another channel to the address, open all along
        seen = []
        try:
            for alive in [False, True] * 3:
                relay_alive[0] = alive
                check = aio_channel(address, fresh=True)
                try:
                    seen.append((alive, await reaches(check)))
                finally:
                    await check.close()
                await reaches(other, wait=alive)  # (the other channel connects, or fails, through the same relay)
        finally:
            await other.close()
            tunnel_server.close()
        return seen

    with in_process_server(tiny_llama, BlockRange(0, 2)) as server:
        seen = asyncio.run(checks(int(server.address.rsplit(":", 1)[1])))
    assert seen == [(False, False), (True, True)] * 3


def test_the_port_a_dial_back_checked_stays_bound_until_grpc_takes_it(tiny_llama, tmp_path):
    """A server that checks its reachability (a relay dials its port back) holds that port until gRPC binds it: a
    port released after the check was taken by another process while the blocks loaded (CI under load: gRPC's bind
    failed "Address already in use")."""
    import errno
    import socket

    from swarmlm.config import ServerConfig
    from swarmlm.server.network import ServerNetwork
    from swarmlm.swarm.local import LocalSwarm

    with LocalSwarm(tiny_llama, log_dir=tmp_path) as swarm:
        swarm.start_dht()  # (a relay: it dials back)
        network = ServerNetwork(ServerConfig(model_dir=tiny_llama, blocks=None, reachability="auto",
                                             initial_peers=tuple(swarm.initial_peers)))
        try:
            assert network.reach.direct and "dial-back" in network.reach.why, network.reach
            with socket.socket() as other, pytest.raises(OSError) as taken:  # another process's bind, meanwhile
                other.bind(("127.0.0.1", network.port))
            assert taken.value.errno == errno.EADDRINUSE
            port = network.grpc_port()  # released for gRPC, which binds it at once
            with socket.create_server(("127.0.0.1", port)):
                pass
        finally:
            network.close()
