"""Hole 1 of issue 39 (relay hijack): a stranger with its own key publishes a record naming a relayed server's
`p2p/<peer id>` address with a relay of its own (refreshed every second). A client must still reach the server
through the server's own relay: only the record of the server that passed the connect check there sets that
address's relay, and the server signs the relay it is at (swarm/identity.py `signed_address`). The attack is
swarmlm/bench/relay_attacks.py `record_hijack` (also a row of `benchmarks/attacks.py --relay`)."""
from __future__ import annotations

import pytest

from swarmlm.bench.relay_attacks import record_hijack
from swarmlm.swarm.local import LocalSwarm
from swarmlm.types import BlockRange
from tests.swarm_helpers import greedy_reference

pytestmark = pytest.mark.slow


def test_a_strangers_record_naming_a_relayed_server_changes_no_tunnel(tiny_llama, tmp_path):
    ids, want = greedy_reference(tiny_llama, "the quick brown fox", 8)
    with LocalSwarm(tiny_llama, log_dir=tmp_path) as swarm:
        swarm.start_dht()
        server = swarm.start_server(BlockRange(0, 6), extra=["--reachability", "relayed"])
        assert server.address.startswith("p2p/")
        for seen in record_hijack(swarm, server, ids, 8, clients=2):  # two new clients, each reading the lie
            assert seen["tokens"] == want
            # (the client before took the relay of whichever record it read last: the stranger's)
            assert seen["relay_after_reads"] == [seen["own_relay"]] * 2, seen
            assert seen["owner"] == server.server_id
