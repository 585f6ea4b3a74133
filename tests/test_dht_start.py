"""The DHT node hivemind forks is restarted when it does not become ready (a fork beside live threads can hang)."""
from __future__ import annotations

import hivemind

from swarmlm.swarm import dht as dht_module


def test_a_node_that_is_not_ready_in_time_is_killed_and_started_again(monkeypatch):
    real_wait = hivemind.DHT.wait_until_ready
    calls: list[hivemind.DHT] = []

    def first_hangs(self, timeout=None):
        calls.append(self)
        if len(calls) == 1:  # what a deadlocked child looks like from here: no readiness within the timeout
            raise TimeoutError
        return real_wait(self, timeout)

    monkeypatch.setattr(hivemind.DHT, "wait_until_ready", first_hangs)
    node = dht_module.start_dht(ready_timeout_s=30.0)
    try:
        assert len(calls) == 2
        assert not calls[0].is_alive()  # the first node was killed, not left behind
        assert node is calls[1] and node.is_alive() and node.get_visible_maddrs()
    finally:
        node.shutdown()
