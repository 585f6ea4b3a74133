"""Issue 39, hole 6: prompts must not leak between users of one gateway. Each user (client key: the API key, or the
peer's address when keys are off, and OpenAI's `user` field) has a prefix scope of its own, derived from a gateway
secret, so no user starts from another's cached prompt; and servers tell strangers no per-request counters (hits,
hit tokens, tokens computed): watching them, a user once recovered another's PIN in 100 guesses."""
from __future__ import annotations

import pytest
import torch

from swarmlm.swarm.local import even_split
from swarmlm.wire import swarm_pb2 as pb
from tests.swarm_helpers import client_of, in_process_swarm, stub

PROMPT = "My PIN is 4711. " * 8 + "Please remember it."


def test_a_public_servers_info_tells_strangers_no_per_request_counters(tiny_bloom):
    ids = torch.randint(10, 250, (1, 40), generator=torch.Generator().manual_seed(3))
    with in_process_swarm(tiny_bloom, even_split(6, 2)) as swarm:
        client = client_of(swarm)
        for _ in range(2):  # the second one starts from the first one's prefix
            client.generate(ids, max_new_tokens=2, do_sample=False)
        assert client.last_stats.cached_tokens > 0
        client.close()
        infos = [stub(a).Info(pb.InfoRequest()) for a in swarm.addresses]
    assert all(i.prefix_cache.entries > 0 for i in infos)  # (the cache works)
    assert [(i.tokens_computed, i.prefix_cache.hits, i.prefix_cache.hit_tokens) for i in infos] == [(0, 0, 0)] * 2
    assert not any(i.HasField("gc") for i in infos)  # (collections and their pauses follow the requests served)


@pytest.mark.slow
def test_each_user_of_a_gateway_has_its_own_prefix_scope(tiny_bloom, tmp_path):
    import httpx2 as httpx

    from tests.swarm_helpers import gateway_stack

    def ask(gateway, user: str) -> None:
        reply = httpx.post(f"{gateway.url}/v1/completions", timeout=120, json={
            "model": tiny_bloom, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "user": user})
        assert reply.status_code == 200, reply.text

    def hit_tokens(swarm) -> int:
        return sum(stub(s.address).Info(pb.InfoRequest()).prefix_cache.hit_tokens for s in swarm.servers)

    with gateway_stack(tiny_bloom, tmp_path, server_extra=lambda i: ["--publish-counters"]) as (swarm, gateway):
        ask(gateway, "alice")
        start = hit_tokens(swarm)
        ask(gateway, "bob")  # the same prompt, another user: computed again (before: started from alice's)
        after_bob = hit_tokens(swarm)
        ask(gateway, "alice")  # alice's own prompt again: found
        after_alice = hit_tokens(swarm)
    assert after_bob == start
    assert after_alice > after_bob


def test_scopes_differ_per_user_and_peer_and_repeat_for_the_same_one():
    from swarmlm.api.admission import user_scope

    a = user_scope(b"s" * 32, "ip:10.0.0.1", None)
    assert a == user_scope(b"s" * 32, "ip:10.0.0.1", None) and len(a) == 16
    others = [user_scope(b"s" * 32, "ip:10.0.0.2", None), user_scope(b"s" * 32, "ip:10.0.0.1", "bob"),
              user_scope(b"t" * 32, "ip:10.0.0.1", None)]  # another peer, another user, another gateway
    assert a not in others and len(set(others)) == 3
