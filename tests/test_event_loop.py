"""swarmlm/event_loop.py: the server, the client's loop thread, the DHT node's and the P2P daemon's threads run on the
loop it chooses: uvloop's by default, asyncio's with SWARMLM_EVENT_LOOP=asyncio (inherited by the servers a
process starts)."""
from __future__ import annotations

import asyncio

import pytest
import uvloop

from swarmlm import event_loop
from swarmlm.types import BlockRange


async def _running_loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


def _is_uvloop(loop: asyncio.AbstractEventLoop) -> bool:
    return isinstance(loop, uvloop.Loop)


@pytest.mark.parametrize("setting, expected", [(None, "uvloop"), ("uvloop", "uvloop"), ("asyncio", "asyncio")])
def test_every_loop_of_a_swarm_is_the_chosen_one(tiny_bloom, monkeypatch, setting, expected):
    from swarmlm.client.channels import LoopThread
    from swarmlm.swarm.dht_thread import ThreadDHT
    from swarmlm.swarm.local import LocalSwarm
    from swarmlm.swarm.p2p_link import P2PNode

    if setting is None:
        monkeypatch.delenv(event_loop.ENV, raising=False)
    else:
        monkeypatch.setenv(event_loop.ENV, setting)
    assert event_loop.kind() == expected
    client = LoopThread()  # (a new one, made under this setting: not the process's shared instance)
    dht = ThreadDHT()
    daemon = None
    try:
        daemon = P2PNode(replicate=dht.daemon_maddr())
        running = [client.run(_running_loop(), 10), dht._call(_running_loop()).result(10),
                   daemon.run(_running_loop(), 10)]
        assert [_is_uvloop(loop) for loop in running] == [expected == "uvloop"] * 3
        assert event_loop.run(_running_loop()).__class__ is running[0].__class__  # (the server's `run`)
        with LocalSwarm(tiny_bloom, with_dht=False) as local:
            server = local.start_server(BlockRange(0, 1))
            assert server.ready["event_loop"] == expected  # what the server process's running loop is
    finally:
        if daemon is not None:
            daemon.shutdown()
        dht.shutdown()
        client.loop.call_soon_threadsafe(client.loop.stop)
        client.thread.join(10)
        client.loop.close()


def test_name_of_tells_the_two_loops_apart():
    for make, name in ((uvloop.new_event_loop, "uvloop"), (asyncio.new_event_loop, "asyncio")):
        loop = make()
        try:
            assert event_loop.name_of(loop) == name
        finally:
            loop.close()


def test_an_unknown_setting_is_one_clear_error(monkeypatch):
    monkeypatch.setenv(event_loop.ENV, "libuv")
    with pytest.raises(ValueError, match=r"SWARMLM_EVENT_LOOP='libuv': expected one of auto, uvloop, asyncio"):
        event_loop.new_loop()
