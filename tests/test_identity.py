"""A server's id is its key's: forged DHT records change nothing, far expirations are refused, and a server that
cannot prove the id it was announced with (a signed challenge) is never routed to."""
from __future__ import annotations

import asyncio
import os
import stat
import threading
from dataclasses import replace

import pytest
from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.model.random_checkpoint import init_checkpoint
from swarmlm.swarm.dht import announce, fetch_records, owner_subkey, visible_addrs
from swarmlm.swarm.dht_thread import ThreadDHT
from swarmlm.swarm.identity import Identity, id_of, new_nonce, sign_info, verify_info
from swarmlm.swarm.local import LocalSwarm
from swarmlm.swarm.records import MAX_RECORD_TTL_S, ServerRecord, block_key
from swarmlm.types import BlockRange
from swarmlm.wire import swarm_pb2 as pb
from tests.swarm_helpers import greedy_reference


class RawDHT(ThreadDHT):
    """What an attacker runs: hivemind's DHT node with hivemind's signature check only (none of swarmlm's rules),
    on a thread of this process (no fork beside the client's gRPC threads)."""

    def __init__(self, initial_peers, key: Identity) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.node = None
        self.node = self._call(DHTNode.create(initial_peers=list(initial_peers), host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                              record_validator=key.validator)).result(60)

    def write(self, dht_prefix: str, record: ServerRecord, subkey: str, expiration: float) -> None:
        for b in range(record.start, record.end):
            self.store(block_key(dht_prefix, b), record.to_dict(), expiration_time=expiration, subkey=subkey)


def test_an_id_is_its_public_key_and_persists(tmp_path):
    path = tmp_path / "server.pem"
    first = Identity.load_or_create(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert Identity.load_or_create(path).server_id == first.server_id == id_of(first.public_key)
    assert first.server_id.startswith("Qm") and Identity.load_or_create(None).server_id != first.server_id
    (tmp_path / "bad.pem").write_text("not a key")
    with pytest.raises(ValueError, match="not an unencrypted PEM"):
        Identity.load_or_create(tmp_path / "bad.pem")


def test_connect_check_accepts_only_the_key_holder_at_its_address():
    me, other = Identity.generate(), Identity.generate()
    nonce = new_nonce()
    reply = pb.InfoReply(server_id=me.server_id, model="m", start_block=0, end_block=2)
    sign_info(me, reply, nonce, "127.0.0.1:7000")
    assert verify_info(reply, nonce, me.server_id, "127.0.0.1:7000") is None
    assert "bad signature" in verify_info(reply, new_nonce(), me.server_id)  # a replayed reply
    assert "not as the announced" in verify_info(reply, nonce, other.server_id)  # a record pointing elsewhere
    assert "not the announced" in verify_info(reply, nonce, me.server_id, "127.0.0.1:7001")
    # a server claiming someone else's id with its own key
    claim = pb.InfoReply(server_id=me.server_id, model="m")
    sign_info(other, claim, nonce, "127.0.0.1:7000")
    assert "hashes to" in verify_info(claim, nonce, me.server_id)
    # every signed field is covered: change one and the signature fails
    reply.model = "other"
    assert "bad signature" in verify_info(reply, nonce, me.server_id)
    framed = pb.InfoReply(server_id=me.server_id, model="m", frame_port=7001)
    sign_info(me, framed, nonce, "127.0.0.1:7000")
    assert verify_info(framed, nonce, me.server_id) is None
    framed.frame_port = 7002  # a framed step port put in by someone on the path
    assert "bad signature" in verify_info(framed, nonce, me.server_id)
    assert "did not sign" in verify_info(pb.InfoReply(server_id=me.server_id), nonce)


def test_forged_records_and_far_expirations_change_nothing():
    victim, attacker = Identity.generate(), Identity.generate()
    boot = ThreadDHT(client_mode=False)  # in-process: no fork beside earlier tests' gRPC threads
    peers = visible_addrs(boot)
    honest = ThreadDHT(peers, client_mode=False, validator=victim.validator)
    rogue = RawDHT(peers, attacker)
    reader = ThreadDHT(peers, client_mode=True)
    try:
        real = ServerRecord(server_id=victim.server_id, address="127.0.0.1:5000", start=0, end=2, decode_s=0.01)
        assert announce(honest, "m", real, 8, subkey=owner_subkey(victim.server_id, victim.validator))
        now = get_dht_time()
        fake = dict(address="127.0.0.2:6666", start=0, end=2, decode_s=1e-9)
        # under the victim's id, signed by the attacker's own key: newer, and living for a year
        rogue.write("m", ServerRecord(server_id=victim.server_id, **fake),
                    owner_subkey(victim.server_id, attacker.validator), now + 365 * 86400)
        rogue.write("m", ServerRecord(server_id=victim.server_id, **fake),
                    owner_subkey(victim.server_id, attacker.validator), now + 30)
        # under its own id, but expiring far beyond the cap
        rogue.write("m", ServerRecord(server_id=attacker.server_id, **fake),
                    owner_subkey(attacker.server_id, attacker.validator), now + 10 * MAX_RECORD_TTL_S)
        # unsigned
        rogue.write("m", ServerRecord(server_id="unsigned", **fake), "unsigned", now + 30)
        seen = fetch_records(reader, "m", range(2))
        assert seen == {victim.server_id: real}
        # the most a forger can do: add a server under its own id, for at most MAX_RECORD_TTL_S
        # (the client's connect check then excludes it: see the swarm test below)
        rogue.write("m", ServerRecord(server_id=attacker.server_id, **fake),
                    owner_subkey(attacker.server_id, attacker.validator), get_dht_time() + MAX_RECORD_TTL_S - 1)
        seen = fetch_records(reader, "m", range(2))
        assert seen[victim.server_id] == real and seen[attacker.server_id].address == "127.0.0.2:6666"
    finally:
        for d in (reader, rogue, honest, boot):
            d.shutdown()


# ---- a real swarm ----------------------------------------------------------------------------------------------
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def swarm(tiny_bloom, tmp_path_factory):
    # a rogue server: other weights of the same architecture, its own key, announced under this model's namespace
    other = init_checkpoint("tiny-bloom", tmp_path_factory.mktemp("other-bloom"), seed=7)
    with LocalSwarm(tiny_bloom) as swarm, LocalSwarm(other, with_dht=False) as rogue_swarm:
        swarm.start([BlockRange(0, 6)])
        client = DistributedModelForCausalLM.from_pretrained(tiny_bloom, initial_peers=swarm.initial_peers)
        try:
            rogue_swarm.initial_peers = swarm.initial_peers
            rogue = rogue_swarm.start_server(BlockRange(0, 3), extra=["--dht-prefix", client.remote.dht_prefix])
            yield swarm, rogue, client
        finally:
            client.close()


@pytest.fixture(scope="module")
def reference(tiny_bloom):
    return greedy_reference(tiny_bloom, "a forged record", NEW_TOKENS)


@pytest.mark.slow
def test_forged_and_rogue_records_never_reach_a_route(swarm, reference):
    swarm, rogue, client = swarm
    victim = swarm.servers[0]
    remote = client.remote
    attacker = Identity.generate()
    raw = RawDHT(swarm.initial_peers, attacker)
    try:
        honest = fetch_records(remote.dht, remote.dht_prefix, range(6))
        lure = dict(decode_s=1e-9, prefill_a_s=1e-9, prefill_b_s=0.0, cache_bytes_free=1 << 30)
        until = get_dht_time() + MAX_RECORD_TTL_S - 1
        # 1. the victim's id pointing at the rogue server, signed by the attacker's key: every reader ignores it
        raw.write(remote.dht_prefix, replace(honest[victim.server_id], address=rogue.address, **lure),
                  owner_subkey(victim.server_id, attacker.validator), until)
        # 2. a valid record under the attacker's own id, copying the honest server's range, fingerprint and address,
        #    and faster (the router would pick it): that server cannot sign for the attacker's id
        raw.write(remote.dht_prefix, replace(honest[victim.server_id], server_id=attacker.server_id, **lure),
                  owner_subkey(attacker.server_id, attacker.validator), until)

        ids, want = reference
        out = client.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        assert out[0, ids.shape[1]:].tolist() == want  # exact: the rogue's weights were never used
        assert remote.view.records[victim.server_id].address == victim.address
        assert "answers as" in remote.rejected[(attacker.server_id, victim.address)]
        assert (rogue.server_id, rogue.address) in remote.rejected  # its own record, other weights
        assert set(remote.view.records) == {victim.server_id}
        assert {hop.server_id for hop in client.last_stats.route} == {victim.server_id}
    finally:
        raw.shutdown()
