"""Prompt caches that outlive a session (issue 25): keys, the server's store and its budget in one process; then
conversations through servers (in this process where only the protocol is at stake; processes for a private swarm,
the off switch's flag and SIGKILLs): the same tokens with and without the cache, earlier turns not prefilled again,
logits of a fresh prefill, scopes (open swarm: private; private swarm: shared on request), the off switches."""
from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from transformers import AutoModelForCausalLM

from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.client.prefix import held_runs, keys_for, span_salts
from swarmlm.errors import CapacityExceeded
from swarmlm.server.prefix_cache import PrefixCache, tag_runs
from swarmlm.server.kv_cache import SpanCache
from swarmlm.server.sessions import SessionTable
from swarmlm.server.stage import Stage
from swarmlm.swarm.local import even_split
from swarmlm.swarm.private import create_swarm_key, load_swarm_key
from swarmlm.types import BlockRange, Span
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire.prefix_keys import RUN_TOKENS, chain_keys, scope_digest, tag_of
from tests.swarm_helpers import (active_sessions, client_of, even_out_view, in_process_swarm, poll_until, running_swarm,
                                  server_processes, stub)

torch.set_num_threads(1)
NEW_TOKENS = 5


# ---- keys ------------------------------------------------------------------------------------------------------
def test_chain_keys_name_exactly_their_runs():
    ids = list(range(100, 170))
    keys = chain_keys(b"salt", ids, 10)
    assert len(keys) == 70 // RUN_TOKENS  # full runs only
    assert chain_keys(b"salt", ids[:40], 10) == keys[:2]  # a prefix's keys are the first keys
    changed = ids[:20] + [7] + ids[21:]
    assert chain_keys(b"salt", changed, 10)[:1] == keys[:1] and chain_keys(b"salt", changed, 10)[1:] != keys[1:]
    assert chain_keys(b"other", ids, 10)[0] != keys[0]
    assert keys_for(b"salt", ids[:32], leave=1) == keys[:1]  # one token at least is left to send


def test_salts_follow_what_changes_a_servers_input_not_how_blocks_are_split():
    def salts(spans, quant=lambda s: "none", wire=lambda s: "float32"):
        return span_salts("m", "float32 none", spans, quant, wire)

    one_split = salts([Span("a", 0, 2), Span("b", 2, 4), Span("c", 4, 6)])
    other_split = salts([Span("x", 0, 4), Span("y", 4, 6)])
    assert one_split[2] == other_split[1]  # block 4's input: the same hidden states either way
    assert salts([Span("x", 0, 4), Span("y", 4, 6)], quant=lambda s: "int8" if s.server_id == "x" else "none")[1] \
        != other_split[1]
    assert salts([Span("x", 0, 4), Span("y", 4, 6)], wire=lambda s: "float16")[1] != other_split[1]
    assert one_split[0] != one_split[1]


def test_announced_tags_tell_only_the_scopes_holder_how_much_is_cached():
    keys = chain_keys(b"s", list(range(16 * 13)), 13)
    digest = scope_digest(b"k" * 16)
    tags = frozenset(tag_of(digest, keys[r - 1]) for r in tag_runs(13))
    assert tag_runs(13) == [1, 2, 4, 8, 13]
    assert held_runs(b"k" * 16, keys, tags) == 13
    assert held_runs(b"k" * 16, keys[:11], tags) == 8  # a shorter prompt: the power of two below it
    assert held_runs(b"j" * 16, keys, tags) == 0  # another scope cannot read them


# ---- the store and the budget, on a real stage --------------------------------------------------------------------
@pytest.fixture(scope="module")
def stage(tiny_bloom) -> Stage:
    return Stage(tiny_bloom, BlockRange(0, 3))


def _run(stage: Stage, table: SessionTable, tokens: int, seed: int, max_length: int = 64):
    """A session of one row through `stage`, stepped with `tokens` random hidden states; (session, inputs, output)."""
    state = stage.new_state(stage.blocks, 1, max_length)
    session = table.open("peer", state, 1, max_length, stage.cache_bytes(stage.blocks.length, 1, max_length))
    table.reserve(session)
    x = torch.randn(1, tokens, stage.hidden_size, generator=torch.Generator().manual_seed(seed))
    return session, x, stage.step(state, x, torch.ones(1, tokens, dtype=torch.long))


def test_a_restored_prefix_continues_as_a_fresh_prefill(stage):
    table = SessionTable(1 << 30, 16, prefixes=PrefixCache(1 << 30))
    session, x, _ = _run(stage, table, 40, seed=1)
    keys = tuple(bytes([i]) * 16 for i in range(2))
    assert table.prefixes.save(b"d" * 32, stage.blocks, keys, session.state.cache, table.free_bytes)
    entry, runs = table.prefixes.lookup(b"d" * 32, stage.blocks, keys[:1] + (b"?" * 16,))
    assert runs == 1  # the longest key of the request that is held
    assert table.prefixes.lookup(b"e" * 32, stage.blocks, keys) is None  # another scope
    entry, runs = table.prefixes.lookup(b"d" * 32, stage.blocks, keys)
    restored = stage.new_state(stage.blocks, 1, 64)
    restored.cache, restored.mask = table.prefixes.restore(entry, runs, 64)
    rest = x[:, 32:]
    got = stage.step(restored, rest, torch.ones(1, 8, dtype=torch.long))
    fresh = stage.new_state(stage.blocks, 1, 64)
    want = stage.step(fresh, x, torch.ones(1, 40, dtype=torch.long))[:, 32:]
    assert (got - want).abs().max().item() < 1e-5


def test_eviction_under_a_small_budget_keeps_live_sessions_and_memory_within_it(stage):
    per_session = stage.cache_bytes(stage.blocks.length, 1, 64)
    table = SessionTable(3 * per_session, 16, prefixes=PrefixCache(2 * per_session))
    live, x_live, out_live = _run(stage, table, 20, seed=7)  # stays open throughout
    for i in range(6):  # finished sessions leave prefixes of 48 tokens: more than the budget holds
        s, _, _ = _run(stage, table, 48, seed=10 + i)
        table.prefixes.save(b"d" * 32, stage.blocks, tuple(bytes([i, j]) * 8 for j in range(3)), s.state.cache,
                            table.free_bytes)
        table.close(s.session_id)
        assert table.held_bytes <= table.cache_bytes and table.prefixes.bytes <= 2 * per_session
    assert table.prefixes.stats.evictions > 0 and table.prefixes.entries
    # new sessions take their reservations: cached prefixes give way, down to none
    a, _, _ = _run(stage, table, 8, seed=20)
    b, _, _ = _run(stage, table, 8, seed=21)
    assert table.prefixes.bytes == 0 and table.held_bytes <= table.cache_bytes
    with pytest.raises(CapacityExceeded):  # a live session's reservation is never taken
        _run(stage, table, 8, seed=22)
    # a save cannot take reserved room either
    assert not table.prefixes.save(b"d" * 32, stage.blocks, (b"z" * 16,), a.state.cache, table.free_bytes)
    # the live session goes on as if nothing happened
    nxt = torch.randn(1, 1, stage.hidden_size, generator=torch.Generator().manual_seed(8))
    got = stage.step(live.state, nxt, torch.ones(1, 1, dtype=torch.long))
    fresh = stage.new_state(stage.blocks, 1, 64)
    stage.step(fresh, x_live, torch.ones(1, 20, dtype=torch.long))
    assert (got - stage.step(fresh, nxt, torch.ones(1, 1, dtype=torch.long))).abs().max().item() < 1e-5


# ---- through server processes ---------------------------------------------------------------------------------------
def _counters(swarm) -> list[tuple[int, int]]:
    """(tokens computed, prefix tokens not sent) per server."""
    infos = [stub(a).Info(pb.InfoRequest()) for a in swarm.addresses]
    return [(i.tokens_computed, i.prefix_cache.hit_tokens) for i in infos]


def _conversation(client, turns: list[torch.Tensor]) -> list[list[int]]:
    """Each turn: everything so far + the user's new tokens, answered greedily; the answers."""
    history, answers = torch.zeros(1, 0, dtype=torch.long), []
    for user in turns:
        prompt = torch.cat([history, user], 1)
        out = client.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, do_sample=False)  # (a generated pad id is a token here)
        cached = client.last_stats.cached_tokens
        held = max(history.shape[1] - 1, 0)  # what the previous turn's session held
        assert cached == (held // RUN_TOKENS * RUN_TOKENS if client.prefix_context else 0)
        answers.append(out[0, prompt.shape[1]:].tolist())
        history = out
    return answers


def _turns(seed: int, first: int = 37) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 250, (1, first if i == 0 else 9), generator=g) for i in range(4)]


@pytest.fixture(scope="module")
def two_servers(tiny_bloom):
    with in_process_swarm(tiny_bloom, even_split(6, 2), publish_counters=True) as swarm:  # (servers in this process)
        yield swarm


@pytest.mark.slow
def test_a_4_turn_conversation_gives_the_same_tokens_and_earlier_turns_are_not_prefilled_again(tiny_bloom,
                                                                                                two_servers):
    swarm = two_servers
    off = client_of(swarm, prefix_cache=False)
    on = client_of(swarm)
    try:
        before = _counters(swarm)
        want = _conversation(off, _turns(1))
        middle = _counters(swarm)
        got = _conversation(on, _turns(1))
        after = _counters(swarm)
    finally:
        off.close()
        on.close()
    assert got == want
    # every turn's session holds its prompt + NEW_TOKENS - 1; the next turn finds its full runs on both servers
    held, total = [], 0
    for user in _turns(1):
        prompt = total + user.shape[1]
        total = prompt + NEW_TOKENS
        held.append(prompt + NEW_TOKENS - 1)
    saved = sum(h // RUN_TOKENS * RUN_TOKENS for h in held[:3])
    for (c0, h0), (c1, h1), (c2, h2) in zip(before, middle, after):
        assert h1 == h0  # the client without the cache sent everything
        assert h2 - h1 == saved > 0  # tokens of earlier turns not sent again...
        assert (c2 - c1) == (c1 - c0) - saved  # ...and not computed again


@pytest.mark.slow
def test_logits_from_a_cached_prefix_match_a_fresh_prefill_and_transformers(tiny_bloom, two_servers):
    swarm = two_servers
    ids = torch.randint(10, 250, (1, 50), generator=torch.Generator().manual_seed(3))
    on = client_of(swarm)
    off = client_of(swarm, prefix_cache=False)
    ref = AutoModelForCausalLM.from_pretrained(tiny_bloom).eval()
    try:
        with on.inference_session(max_length=60).open(ids[0, :40].tolist()) as first:
            on.step_logits(first, ids[:, :40], last_only=True)  # leaves 2 runs (39 tokens held) at close
        with on.inference_session(max_length=60).open(ids[0].tolist()) as cached:
            assert cached.position == 32  # started from the cached prefix
            got = on.step_logits(cached, ids, last_only=True)
            got_next = on.step_logits(cached, ids[:, :1], last_only=True)
        with off.inference_session(max_length=60) as fresh:
            want = off.step_logits(fresh, ids)[:, -1:]
            want_next = off.step_logits(fresh, ids[:, :1])
        with torch.no_grad():
            plain = ref(ids).logits[:, -1:]
        assert (got - want).abs().max().item() < 1e-4 and (got - plain).abs().max().item() < 1e-4
        assert (got_next - want_next).abs().max().item() < 1e-4
    finally:
        on.close()
        off.close()


@pytest.mark.slow
def test_n_copies_of_a_prompt_start_from_its_cached_prefix(tiny_bloom, two_servers):
    """A session of n rows (num_return_sequences, the gateway's n) opens from the prompt's cached prefix too: its
    prompt step sends what the prefix leaves, then the cache is copied to the n rows. The same tokens as without."""
    ids = torch.randint(10, 250, (1, 40), generator=torch.Generator().manual_seed(11))
    client = DistributedModelForCausalLM.from_pretrained(tiny_bloom, servers=two_servers.addresses)
    try:
        greedy = client.generate(ids, max_new_tokens=4, do_sample=False)  # its session keeps 2 runs at close
        before = _counters(two_servers)
        rows = client.generate(ids, max_new_tokens=4, do_sample=True, top_k=1, num_return_sequences=3,
                               speculative="auto")
        after = _counters(two_servers)
    finally:
        client.close()
    assert client.last_stats.cached_tokens == 2 * RUN_TOKENS
    assert all((h1 - h0) == 2 * RUN_TOKENS for (_, h0), (_, h1) in zip(before, after))  # not sent, not computed
    assert rows.tolist() == greedy.repeat(3, 1).tolist()


@pytest.mark.slow
def test_in_an_open_swarm_a_second_client_does_not_see_the_first_clients_entries(tiny_bloom, two_servers):
    swarm = two_servers
    ids = torch.randint(10, 250, (1, 50), generator=torch.Generator().manual_seed(4))
    first = client_of(swarm)
    second = client_of(swarm)
    try:
        for _ in range(2):
            first.generate(ids, max_new_tokens=2, do_sample=False)
        with first.inference_session(max_length=60).open(ids[0].tolist()) as mine:
            assert mine.position == 48
        with second.inference_session(max_length=60).open(ids[0].tolist()) as theirs:
            assert theirs.position == 0
    finally:
        first.close()
        second.close()


@pytest.mark.slow
def test_in_a_private_swarm_sharing_is_a_choice(tiny_bloom, tmp_path):
    key_file = tmp_path / "swarm.key"
    create_swarm_key(key_file)
    key = load_swarm_key(key_file)
    ids = torch.randint(10, 250, (1, 50), generator=torch.Generator().manual_seed(5))
    with server_processes(tiny_bloom, even_split(6, 2), dht=False, swarm_key_file=key_file) as swarm:
        clients = [client_of(swarm, swarm_key=key, prefix_share=share) for share in (True, True, False)]
        try:
            clients[0].generate(ids, max_new_tokens=2, do_sample=False)
            held = []
            for client in clients[1:]:
                with client.inference_session(max_length=60).open(ids[0].tolist()) as session:
                    held.append(session.position)
            assert held == [48, 0]  # a member sharing sees it; a member keeping its own scope does not
        finally:
            for client in clients:
                client.close()


@pytest.mark.slow
def test_both_switches_turn_it_off(tiny_bloom):
    ids = torch.randint(10, 250, (1, 40), generator=torch.Generator().manual_seed(6))
    no_cache = ["--prefix-cache-mb", "0", "--publish-counters"]
    with running_swarm(tiny_bloom, even_split(6, 2), dht=False, server_args=no_cache) as (swarm, client):
        a = client.generate(ids, max_new_tokens=3, do_sample=False)
        b = client.generate(ids, max_new_tokens=3, do_sample=False)
        assert torch.equal(a, b)
        infos = [stub(addr).Info(pb.InfoRequest()) for addr in swarm.addresses]
        assert not any(i.HasField("prefix_cache") for i in infos)
        assert all(i.tokens_computed == 2 * (40 + 2) for i in infos)
    with pytest.raises(ValueError, match="private swarm"):
        DistributedModelForCausalLM.from_pretrained(tiny_bloom, servers=["127.0.0.1:1"], prefix_share=True)


# ---- the gateway ---------------------------------------------------------------------------------------------------
SYSTEM = ("You are a careful assistant for a library. Answer in one short sentence, cite the shelf number when you "
          "know it, never invent a book, and say when the library is closed. Opening hours are nine to five.")


def _chat(gateway, tiny_bloom, messages: list[dict]) -> str:
    import httpx2 as httpx  # (what openai is built on)

    reply = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=120, json={
        "model": tiny_bloom, "messages": messages, "max_tokens": 6, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def _hit_tokens(swarm) -> list[int]:
    return [stub(s.address).Info(pb.InfoRequest()).prefix_cache.hit_tokens for s in swarm.servers]


@pytest.mark.slow
def test_gateway_chats_sharing_a_system_prompt_reuse_it(tiny_bloom, tmp_path):
    from transformers import AutoTokenizer

    from tests.swarm_helpers import gateway_stack

    tokenizer = AutoTokenizer.from_pretrained(tiny_bloom)
    model = AutoModelForCausalLM.from_pretrained(tiny_bloom).eval()

    def want(text: str) -> str:
        ids = tokenizer(text, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=6, do_sample=False)
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    system = {"role": "system", "content": SYSTEM}
    with gateway_stack(tiny_bloom, tmp_path, server_extra=lambda i: ["--publish-counters"]) as (swarm, gateway):
        first = _chat(gateway, tiny_bloom, [system, {"role": "user", "content": "Where are the atlases?"}])
        before = _hit_tokens(swarm)
        other = _chat(gateway, tiny_bloom, [system, {"role": "user", "content": "Is it open on Sunday?"}])
        shared = _hit_tokens(swarm)
        turn2 = [system, {"role": "user", "content": "Where are the atlases?"},
                 {"role": "assistant", "content": first}, {"role": "user", "content": "And the maps?"}]
        second_turn = _chat(gateway, tiny_bloom, turn2)
        after = _hit_tokens(swarm)
    system_tokens = len(tokenizer(f"System: {SYSTEM}\nUser:").input_ids)
    assert all(s - b >= system_tokens // RUN_TOKENS * RUN_TOKENS > 0 for s, b in zip(shared, before))
    assert all(a > s for a, s in zip(after, shared))  # the conversation's first turn, found again
    assert other == want(f"System: {SYSTEM}\nUser: Is it open on Sunday?\nAssistant:")
    assert second_turn == want(f"System: {SYSTEM}\nUser: Where are the atlases?\nAssistant: {first}\n"
                               "User: And the maps?\nAssistant:")


# ---- routing that knows, in the one performance model ---------------------------------------------------------------
def test_routes_prefer_servers_holding_the_prefix_unless_their_load_costs_more():
    from swarmlm.perf.model import ComputeProfile, Network, PerfModel
    from swarmlm.perf.prefix import prefill_with_prefix_s, prefix_saving_terms
    from swarmlm.planner.routing import WaitingAwareRouter

    net = Network(default_rtt_s=0.001)
    profile = ComputeProfile(0.001, 0.002, 0.004, 0.010, 0.030)  # prefill 1 ms/token/block; contended decodes
    perf = PerfModel({"a": profile, "b": profile}, net, hidden_bytes_per_token=4096.0)
    router = WaitingAwareRouter(perf, 4)
    for sid in ("a", "b"):
        router.set_server(sid, BlockRange(0, 4), 100)
    assert prefix_saving_terms(perf, "c", "b", 400)[1] == pytest.approx(0.4)  # 400 tokens' prefill per block
    assert prefill_with_prefix_s(perf, "b", 4, 420, 400) == pytest.approx(4 * profile.prefill_s(20))
    route = lambda held: router.route("c", 0.0, 420, 16, prefix_held=held).spans[0].server_id  # noqa: E731
    assert route({"b": 400}) == "b" and route({"a": 400}) == "a"
    router.set_load("b", 100, sessions=12)  # b holds the prefix but runs 12 sessions: its f(13) outweighs it...
    assert route({"b": 400}) == "a"
    assert route({"b": 400, "a": 0}) == "a" and route({}) == "a"
    router.set_load("b", 100, sessions=1)  # ...and with little load it wins again
    assert route({"b": 400}) == "b"


def test_the_simulator_models_prefix_hits_and_routes_to_them():
    from swarmlm.perf.model import ComputeProfile, Network, PerfModel
    from swarmlm.sim.arrivals import SimRequest
    from swarmlm.sim.cluster import SimServerConfig
    from swarmlm.sim.routers import PlannerRouter
    from swarmlm.sim.simulator import run_simulation

    profile = ComputeProfile(0.002, 0.010, 0.010)  # 2 ms per prompt token per block
    net = Network()
    net.set_link("c", "A", 0.002)  # A is closer to the client...
    net.set_link("c", "B", 0.004)
    net.set_link("first", "A", 1000.0)  # ...but the first request (another user of the same gateway) ran on B
    net.set_link("first", "B", 0.004)
    perf = PerfModel({"A": profile, "B": profile}, net)

    def simulate(prefix_tokens: int):
        reqs = [SimRequest(0, "first", 0.0, 420, 4, "system", prefix_tokens)]
        reqs += [SimRequest(i, "c", 10.0 * i, 420, 4, "system", prefix_tokens) for i in range(1, 4)]
        servers = [SimServerConfig("A", 0, 4, slots=100), SimServerConfig("B", 0, 4, slots=100)]
        router = PlannerRouter.build(perf, 4, [("A", BlockRange(0, 4), 100), ("B", BlockRange(0, 4), 100)],
                                     "waiting-aware")
        return run_simulation(servers, perf, router, reqs)

    cached, plain = simulate(400), simulate(0)
    assert cached.summary["prefix_hits"] == 3 and cached.summary["prefix_hit_tokens"] == 1200
    assert all(r.route[0].server_id.startswith("B") for r in cached.records)  # later requests go where the prefix is
    assert all(r.route[0].server_id.startswith("A") for r in plain.records[1:])  # without it, the closer server
    for hit, miss in zip(cached.records[1:], plain.records[1:]):
        want = perf.prefill_hop_s("c", "B", 4, 20)  # the 20 tokens after the prefix, alone on B
        assert hit.ttft_s == pytest.approx(want) and hit.ttft_s < miss.ttft_s


# ---- failover ------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_sigkilled_servers_of_a_session_started_from_a_cached_prefix_fail_over_to_the_same_tokens(tiny_bloom):
    """Every block served twice. A conversation's first turn leaves its prefix on its route; the second turn is routed
    to the servers holding it and starts from it; then the server of the second span (its replacement gets the
    prefix's inputs from fresh sessions over the blocks before it) and later the first span's (the embeddings) are
    SIGKILLed: the tokens are those of a client without the cache."""
    ranges = [BlockRange(0, 3), BlockRange(3, 6)]
    ids = torch.randint(10, 250, (1, 45), generator=torch.Generator().manual_seed(9))
    with server_processes(tiny_bloom, ranges + ranges, dht=False) as swarm:
        on = client_of(swarm, ban_base_s=60.0, records_max_age_s=60.0)
        off = client_of(swarm, prefix_cache=False)
        try:
            first = on.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
                                do_sample=False)
            holders = {s.server_id for s in on.last_stats.route}
            prompt = torch.cat([first, torch.randint(10, 250, (1, 6), generator=torch.Generator().manual_seed(10))], 1)
            want = _greedy(off, prompt, 12, kills={})
            # replicas differ by the prefix alone: not by a closed session a server still counts (one running costs
            # f(2) x its compute), nor by speeds or RTTs measured on a busy machine; and the prefix is priced at a
            # per-token prefill of 0.1 ms a block (a tiny model's measured one is noise, down to 0: then holders and
            # the others tie, and the route is whichever server the router lists first)
            assert poll_until(lambda: not any(active_sessions(swarm))), active_sessions(swarm)
            on.remote.refresh()  # the servers' records now announce the prefix
            even_out_view(on, prefill_a_s=1e-4)
            got = _greedy(on, prompt, 12, kills={3: (1, swarm), 8: (0, swarm)}, holders=holders)
        finally:
            on.close()
            off.close()
    assert got == want


def _greedy(client, prompt: torch.Tensor, new: int, kills: dict, holders: set | None = None) -> list[int]:
    """Greedy tokens step by step; at token n in `kills`, SIGKILL the server of the route's span i."""
    import signal

    tokens = []
    with client.inference_session(max_length=prompt.shape[1] + new).open(prompt[0].tolist()) as session:
        if holders is not None:
            assert {s.server_id for s in session.route_spans()} == holders  # routed to the prefix...
            # ...and started from what the first turn's session held (its prompt + 3 of its 4 tokens): 48 tokens
            assert session.position == (prompt.shape[1] - 6 - 1) // RUN_TOKENS * RUN_TOKENS > 0
        logits = client.step_logits(session, prompt, last_only=True)
        for n in range(new):
            if n in kills:
                i, swarm = kills[n]
                victim = next(s for s in swarm.servers if s.server_id == session.spans[i].span.server_id)
                swarm.kill(victim, signal.SIGKILL)
                victim.proc.wait(60)
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(nxt))
            logits = client.step_logits(session, nxt, last_only=True)
        assert sum(r.failovers for r in session.steps) == len(kills)
    return tokens


def test_records_carry_at_most_64_well_formed_tags():
    from swarmlm.swarm.records import ServerRecord

    base = {"server_id": "s", "address": "127.0.0.1:1", "start": 0, "end": 2}
    tags = "".join(f"{i:016x}" for i in range(64))
    assert len(ServerRecord.from_dict({**base, "prefix_tags": tags}).prefix_tag_set) == 64
    for bad in (tags + "0" * 16, "abc", "G" * 16, "0" * 15, 5):
        with pytest.raises(ValueError):
            ServerRecord.from_dict({**base, "prefix_tags": bad})


# ---- hostile sequences of legal saves (issue 39, hole 4) -----------------------------------------------------------
class _CountingEntries(OrderedDict):
    """The store's entries, counting how many of them any scan visits."""

    visited = 0

    def __iter__(self):
        for key in super().__iter__():
            type(self).visited += 1
            yield key

    def items(self):
        for item in super().items():
            type(self).visited += 1
            yield item


def _one_run_cache() -> SpanCache:
    kv = torch.zeros(1, 1, 1, RUN_TOKENS, 2)
    return SpanCache.holding(kv, kv.clone(), RUN_TOKENS)


def test_a_save_costs_what_it_evicts_not_what_the_store_holds():
    """16,384 one-run entries of one scope, then saves that each evict one: no save visits the other entries (the
    old eviction re-pointed the index by scanning every remaining entry: 24 s of stalled event loop)."""
    cache = _one_run_cache()
    entry_bytes = 2 * cache.keys[:, :, :, :cache.length].numel() * cache.keys.element_size()
    store = PrefixCache(16384 * entry_bytes)
    store.entries = _CountingEntries()
    blocks = BlockRange(0, 1)
    for i in range(16384):
        assert store.save(b"s" * 32, blocks, (i.to_bytes(16, "big"),), cache, 1 << 40)
    _CountingEntries.visited = 0
    for i in range(4):  # new keys: each save makes room by evicting the least recently used entry
        assert store.save(b"s" * 32, blocks, (b"n" * 15 + bytes([i]),), cache, 1 << 40)
    assert store.stats.evictions >= 4 and _CountingEntries.visited < 100, _CountingEntries.visited
    assert len(store.entries) == 16384 and len(store.index) == 16384  # every held key still answers


def test_one_scope_cannot_evict_another_scopes_prefixes():
    """A stranger's scope saving entry after entry evicts its own entries once it holds more than its share: an
    honest scope's prefix (within its share) survives 1,000 such saves."""
    cache = _one_run_cache()
    entry_bytes = 2 * cache.keys[:, :, :, :cache.length].numel() * cache.keys.element_size()
    store = PrefixCache(20 * entry_bytes)
    blocks, honest = BlockRange(0, 1), (b"h" * 16,)
    assert store.save(b"H" * 32, blocks, honest, cache, 1 << 40)
    for i in range(1000):
        assert store.save(b"S" * 32, blocks, (i.to_bytes(16, "big"),), cache, 1 << 40)
    assert store.lookup(b"H" * 32, blocks, honest) is not None
    assert store.bytes <= store.limit_bytes and store.stats.evictions >= 1000 - 19
