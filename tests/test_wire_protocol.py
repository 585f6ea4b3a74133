"""Peers of another wire protocol refuse each other with one clear message (swarmlm/wire/protocol.py): a server
announces its protocol (Info, DHT record), a client never routes to a server of another one nor to one announcing
none (an older release), and says so when blocks end up missing; a framed HELLO of another protocol is refused at
once. Before, such peers met and failed deep in a session (a MAC mismatch, a parse error)."""
from __future__ import annotations

import io

import pytest

from swarmlm.api.swarm_view import REFUSED, SwarmWatcher
from swarmlm.cli.status_cmd import render, table_console
from swarmlm.errors import MissingBlocks
from swarmlm.swarm.records import ServerRecord, record_from_info
from swarmlm.types import BlockRange
from swarmlm.wire import frames
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire.protocol import MAX_PROTOCOL, PROTOCOL_VERSION, protocol_refusal
from tests.swarm_helpers import client_of, greedy_reference, in_process_swarm

OTHER = PROTOCOL_VERSION + 1  # a newer release's
NEW_TOKENS = 4


# ---- the number and its records -----------------------------------------------------------------------------------
def test_info_and_records_carry_the_protocol_and_an_older_release_announces_none():
    info = pb.InfoReply(server_id="QmServer", start_block=0, end_block=4, protocol=PROTOCOL_VERSION)
    record = record_from_info(info, "127.0.0.1:1")
    assert record.protocol == PROTOCOL_VERSION and ServerRecord.from_dict(record.to_dict()) == record
    assert record_from_info(pb.InfoReply(server_id="QmServer", start_block=0, end_block=4), "127.0.0.1:1").protocol == 0
    older = {k: v for k, v in record.to_dict().items() if k != "protocol"}  # a record written before the field
    assert ServerRecord.from_dict(older).protocol == 0


@pytest.mark.parametrize("hostile, match", [(-1, "negative"), (MAX_PROTOCOL + 1, "protocol"), (1 << 63, "protocol"),
                                            ("1", "type"), (1.0, "type"), (True, "type"), (None, "type"),
                                            ([1], "type")])
def test_hostile_protocol_values_in_a_record_are_rejected(hostile, match):
    base = ServerRecord(server_id="QmServer", address="127.0.0.1:1", start=0, end=2, protocol=1).to_dict()
    with pytest.raises(ValueError, match=match):
        ServerRecord.from_dict({**base, "protocol": hostile})
    assert ServerRecord.from_dict({**base, "protocol": MAX_PROTOCOL}).protocol == MAX_PROTOCOL  # sane: read, refused


def test_the_refusal_says_both_protocols_and_what_to_do():
    assert protocol_refusal(PROTOCOL_VERSION) is None
    other = protocol_refusal(OTHER)
    assert f"wire protocol {OTHER}" in other and f"speaks protocol {PROTOCOL_VERSION}" in other
    assert "run the same swarmlm release" in other
    none = protocol_refusal(0)
    assert "announces no wire protocol" in none and "release before protocol numbers" in none


def test_a_hello_of_another_protocol_is_refused_with_both_numbers():
    assert frames.MAGIC == b"swarmlm-frames/%d\n" % PROTOCOL_VERSION  # the number is in the magic
    with pytest.raises(frames.FrameError, match=f"wire protocol {OTHER}, this server protocol {PROTOCOL_VERSION}: "
                                                "run the same swarmlm release"):
        frames.parse_hello(b"swarmlm-frames/%d\n\x01" % OTHER)
    with pytest.raises(frames.FrameError, match="wrong magic"):  # not ours at all: not told about protocols
        frames.parse_hello(b"swarmlm-frames/99999999999\n\x01")


# ---- a swarm with servers of other releases -----------------------------------------------------------------------
def _announcing(server, protocol: int) -> None:
    """`server` answers Info as a release of wire protocol `protocol` would (0: one before the field)."""
    real = server.service.info

    def info() -> pb.InfoReply:
        reply = real()
        reply.protocol = protocol
        return reply

    server.service.info = info


@pytest.fixture(scope="module")
def mixed(tiny_bloom):
    """[0, 3) and [3, 6) of this release; all 6 blocks from a newer protocol (one hop: the router's first choice if
    it were not refused); [3, 6) from a release that announces none."""
    with in_process_swarm(tiny_bloom, [BlockRange(0, 3), BlockRange(3, 6), BlockRange(0, 6),
                                       BlockRange(3, 6)]) as swarm:
        _announcing(swarm.servers[2], OTHER)
        _announcing(swarm.servers[3], 0)
        yield swarm


def test_servers_of_other_protocols_are_refused_and_the_session_routes_through_the_rest(mixed, tiny_bloom):
    first, second, newer, older = mixed.servers
    ids, want = greedy_reference(tiny_bloom, "another release", NEW_TOKENS)
    client = client_of(mixed)
    try:
        out = client.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        assert out[0, ids.shape[1]:].tolist() == want
        assert {hop.server_id for hop in client.last_stats.route} == {first.server_id, second.server_id}
        remote = client.remote
        assert set(remote.view.records) == {first.server_id, second.server_id}
        assert f"wire protocol {OTHER}" in remote.rejected[(newer.server_id, newer.address)]
        assert "announces no wire protocol" in remote.rejected[(older.server_id, older.address)]

        view = SwarmWatcher(remote).read()  # `swarmlm status`, GET /v1/swarm: listed, with their protocol and why
        rows = {s["id"]: s for s in view["servers"]}
        assert [rows[s.server_id]["protocol"] for s in mixed.servers] == [PROTOCOL_VERSION, PROTOCOL_VERSION, OTHER, 0]
        assert rows[newer.server_id]["state"] == rows[older.server_id]["state"] == REFUSED
        assert rows[first.server_id]["refused"] is None and "same swarmlm release" in rows[newer.server_id]["refused"]
        assert view["coverage"] == [1] * 6 and view["complete"]  # (refused servers cover nothing)
        out = io.StringIO()
        assert render(view, tiny_bloom, table_console(out)) == 0
        assert f"server {newer.server_id[-8:]} is refused: it speaks wire protocol {OTHER}" in out.getvalue()
    finally:
        client.close()


def test_blocks_only_other_protocols_serve_are_missing_with_the_reason(mixed):
    first, _, newer, older = mixed.servers
    mixed_only = type(mixed)(mixed.model_dir, [first, newer, older])  # [3, 6): only the refused ones
    client = client_of(mixed_only, wait_for_blocks_s=0.0)
    try:
        with pytest.raises(MissingBlocks) as err:
            client.generate(greedy_reference(mixed.model_dir, "x", 1)[0], max_new_tokens=1)
        text = str(err.value)
        assert "serves blocks 3-5 (" in text
        assert f"server {newer.server_id} at {newer.address} is refused: it speaks wire protocol {OTHER}, this " \
               f"swarmlm speaks protocol {PROTOCOL_VERSION}: run the same swarmlm release" in text
        assert f"server {older.server_id} at {older.address} is refused: it announces no wire protocol" in text
    finally:
        client.close()


def test_a_servers_loading_record_announces_its_protocol():
    """Before it serves, a server announces its blocks as loading (joining, when it chooses): those records are its
    own claims too, not a release's from before protocol numbers (0)."""
    from swarmlm.config import ServerConfig
    from swarmlm.server.placement import choose_blocks

    announced = []
    blocks = choose_blocks(ServerConfig(model_dir="unused: --blocks given", blocks=BlockRange(0, 2)), dht=None,
                           dht_prefix="x", server_id="s1", announce=announced.append, address="127.0.0.1:1")
    assert blocks == BlockRange(0, 2)
    assert [(r.state, r.protocol) for r in announced] == [("loading", PROTOCOL_VERSION)]


# ---- servers of other protocols cover nothing: for placement, push targets, a client waiting on loaders ----------
def _others_on(start: int, end: int, state: str = "online") -> dict[str, ServerRecord]:
    """A newer release's server and one that announces none (0), both on [start, end)."""
    return {sid: ServerRecord(server_id=sid, address=f"127.0.0.1:{port}", start=start, end=end, state=state,
                              decode_s=0.001, cache_bytes_total=256 << 20, protocol=protocol)
            for sid, port, protocol in (("QmNewer", 1, OTHER), ("QmOlder", 2, 0))}


def test_a_server_placing_itself_ignores_servers_of_other_protocols(tiny_bloom, monkeypatch):
    """Clients refuse them, so the blocks only they serve are a gap: a joining server takes them (its swarm: only
    those two, on [0, 2)), a moving one does not back off for their loaders, and it pushes to none of them."""
    import asyncio

    from swarmlm.config import ServerConfig
    from swarmlm.server.placement import LoadingWatch, choose_blocks
    from swarmlm.server.server import Server
    from swarmlm.swarm import dht as dht_module

    records = _others_on(0, 2)
    monkeypatch.setattr(dht_module, "fetch_records", lambda *args, **kwargs: dict(records))
    config = ServerConfig(model_dir=tiny_bloom, blocks=None, num_blocks=2, join_settle_s=0, announce_period_s=0.01)
    announced = []
    assert choose_blocks(config, dht=object(), dht_prefix="p", server_id="QmMe", announce=announced.append,
                         address="127.0.0.1:3") == BlockRange(0, 2)  # as in an empty swarm: the first window
    assert [(r.state, r.start, r.end) for r in announced] == [("loading", 0, 2)]

    server = Server(config)
    server.dht, server.dht_prefix = object(), "p"
    records = _others_on(0, 2, state="loading")  # both "loading" the gap this server moves to, with smaller ids
    me = ServerRecord(server_id="QmZ", address="127.0.0.1:3", start=0, end=2, state="loading",
                      protocol=PROTOCOL_VERSION)
    assert asyncio.run(server._rival_loader(me, LoadingWatch(300.0))) is None

    class Everyone:  # (server/network.py's: reachable, direct)
        def learn(self, records) -> None:
            pass

        def may_serve(self, record) -> bool:
            return True

    server.network = Everyone()
    records = {**_others_on(0, 2), "QmOurs": ServerRecord(server_id="QmOurs", address="127.0.0.1:4", start=0, end=2,
                                                          protocol=PROTOCOL_VERSION)}
    assert asyncio.run(server._announced(1)) == {"127.0.0.1:4"}


def test_a_client_waits_only_for_loaders_of_its_protocol(monkeypatch):
    """Blocks missing while servers of other protocols announce them as loading: the client would refuse those
    servers once loaded, so it does not wait for them (wait_for_loading_s); a loader of its own protocol it does."""
    from swarmlm.client.remote import RemoteSequence
    from swarmlm.config import ClientConfig
    from swarmlm.swarm import dht as dht_module

    records = _others_on(3, 6, state="loading")
    monkeypatch.setattr(dht_module, "fetch_records", lambda *args, **kwargs: dict(records))
    remote = RemoteSequence(ClientConfig(servers=("127.0.0.1:1",)), num_blocks=6, dht_prefix="p")
    try:
        remote.dht = object()  # (records from the DHT: the patched read)
        remote.refresh()
        assert remote._loading([3, 4, 5]) == []
        records["QmOurs"] = ServerRecord(server_id="QmOurs", address="127.0.0.1:4", start=3, end=6, state="loading",
                                         protocol=PROTOCOL_VERSION)
        remote.refresh()
        assert remote._loading([3, 4, 5]) == ["QmOurs"]
    finally:
        remote.dht = None  # (not a node to shut down)
        remote.close()
