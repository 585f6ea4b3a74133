"""Chunked prefill: the size rule, the bandwidth estimate, and a chunked, pipelined prefill through real servers
giving the logits of one big step (also across a server dying mid-prefill)."""
from __future__ import annotations

import asyncio
import math
import signal
import time

import pytest
import torch

from swarmlm.client.chunking import BandwidthEstimate, chunk_tokens_for_hop, split
from swarmlm.config import ChunkRule
from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.client.streams import SpanStream
from swarmlm.swarm.local import LocalSwarm, even_split
from swarmlm.types import BlockRange
from tests.swarm_helpers import client_of, reference_model, server_processes

# ---- the size rule ------------------------------------------------------------------------------------------


def test_link_bound_hop_gets_transfer_equal_to_compute():
    rule = ChunkRule(min_tokens=1, max_tokens=10_000, message_overhead_s=0.0)
    # 16 KB per token over 100 Mbit/s: 1.31 ms per token on the link; 0.3 ms per token + 20 ms per chunk on the server
    c = chunk_tokens_for_hop(rule, 16 << 10, 100e6, 0.3e-3, 20e-3)
    transfer = c * (16 << 10) * 8 / 100e6
    compute = 0.3e-3 * c + 20e-3
    assert transfer >= compute and transfer - compute < (16 << 10) * 8 / 100e6  # equal to within one token
    # a slower link needs smaller chunks to keep transfer = compute
    assert chunk_tokens_for_hop(rule, 16 << 10, 20e6, 0.3e-3, 20e-3) < c


def test_compute_bound_hop_bounds_the_fixed_cost_share():
    rule = ChunkRule(min_tokens=1, max_tokens=10_000, overhead_fraction=0.1, message_overhead_s=1e-3)
    c = chunk_tokens_for_hop(rule, 256, 10e9, 1e-3, 4e-3)  # a fast link: the server is the bottleneck
    assert c == math.ceil((4e-3 + 1e-3) / (0.1 * 1e-3))
    assert (4e-3 + 1e-3) <= 0.1 * 1e-3 * c


def test_bounds_and_unknown_bandwidth():
    rule = ChunkRule(min_tokens=16, max_tokens=64)
    assert chunk_tokens_for_hop(rule, 1 << 20, 1e6, 1e-6, 0.0) == 16  # tiny: clamped up to the minimum
    assert chunk_tokens_for_hop(rule, 4, 1e12, 1e-3, 1.0) == 64  # huge: clamped down to the maximum
    assert chunk_tokens_for_hop(rule, 4, 0.0, 1e-3, 0.0) == 16
    with pytest.raises(ValueError):
        ChunkRule(min_tokens=10, max_tokens=5)


def test_split_is_exact_and_covers_everything():
    hidden, mask = torch.randn(2, 37, 8), torch.randint(0, 2, (2, 37))
    pieces = split(hidden, mask, 10)
    assert [h.shape[1] for h, _ in pieces] == [10, 10, 10, 7]
    assert torch.equal(torch.cat([h for h, _ in pieces], 1), hidden)
    assert torch.equal(torch.cat([m for _, m in pieces], 1), mask)
    assert len(split(hidden, mask, 100)) == 1


def test_bandwidth_estimate_from_step_timings():
    est = BandwidthEstimate(default_bps=1e9)
    assert est.bandwidth_bps == 1e9 and not est.measured
    est.observe(2_000, 0.020)  # a decode step: the base round trip
    est.observe(1_000, 0.021)
    assert est.rtt_s == 0.020
    for _ in range(5):
        est.observe(1_250_000, 0.020 + 0.100)  # 10 Mbit in 100 ms beyond the base cost
    est.observe(1_250_000, 0.020 + 0.500)  # one disturbed sample does not move the median
    assert est.measured and est.bandwidth_bps == pytest.approx(100e6)


def test_old_samples_stop_counting():
    """A link's past load (a stranger's flood through the same relay) does not stay its measured rate."""
    now = [0.0]
    est = BandwidthEstimate(default_bps=1e9, max_age_s=60.0, clock=lambda: now[0])
    est.observe(2_000, 0.020)
    for _ in range(5):
        est.observe(1_250_000, 0.020 + 1.0)  # 10 Mbit/s while loaded
    assert est.bandwidth_bps == pytest.approx(10e6)
    now[0] = 61.0
    assert est.bandwidth_bps == 1e9 and not est.measured  # nothing recent: the assumed rate again
    est.observe(1_250_000, 0.020 + 0.100)
    assert est.bandwidth_bps == pytest.approx(100e6)


def test_large_messages_outweigh_a_burst_of_small_ones():
    """A token bucket lets a short prompt's 64 KB through at once (it reads as 10x the link); the few large
    messages, which are what chunking is about, decide the estimate."""
    est = BandwidthEstimate(default_bps=1e9)
    est.observe(2_000, 0.020)
    for _ in range(20):
        est.observe(64_000, 0.020 + 0.0017)  # ~300 Mbit/s: through the shaper's burst
    assert est.bandwidth_bps == pytest.approx(64_000 * 8 / 0.0017)
    for _ in range(2):
        est.observe(1_500_000, 0.020 + 0.600)  # 20 Mbit/s: the link's real pace
    assert est.bandwidth_bps == pytest.approx(20e6)


# ---- through real servers -----------------------------------------------------------------------------------

PROMPT_TOKENS = 45


@pytest.fixture(scope="module")
def swarm(tiny_bloom):
    ranges = even_split(6, 3)
    with server_processes(tiny_bloom, ranges + ranges) as swarm:  # every block twice: a failed server has a replacement
        yield tiny_bloom, swarm, reference_model(tiny_bloom)


def _client(swarm, **kw) -> DistributedModelForCausalLM:
    # float32 on the wire: these tests check chunking's exactness, not compression's bounds (test_wire_compress.py)
    return client_of(swarm, ban_base_s=30.0, wire_dtype="float32", **kw)


@pytest.mark.slow
def test_chunked_prefill_gives_the_logits_of_one_step_and_is_pipelined(swarm, monkeypatch):
    path, swarm_, ref = swarm
    ids = torch.randint(3, 500, (2, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding in the second row
    events: list[tuple[str, str, float]] = []
    send, receive = SpanStream.send, SpanStream.receive
    gate = {"route": None, "chunks": 0}  # set for the chunked run: see below

    async def logged_send(self, *args, **kwargs):
        await send(self, *args, **kwargs)
        events.append((self.span.server_id, "send", time.perf_counter()))

    async def logged_receive(self, *args, **kwargs):
        route = gate["route"]
        if route and self.span.server_id == route[0] and _count(events, route[0], "recv") == gate["chunks"] - 1:
            # the first server's last answer is read only once the second server has been sent a chunk: a
            # pipelined client gets there at once, one that waits for the whole prompt never does (the send would
            # have to come after this read), whatever the machine's load
            deadline = time.monotonic() + 60
            while not _count(events, route[1], "send") and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        out = await receive(self, *args, **kwargs)
        events.append((self.span.server_id, "recv", time.perf_counter()))
        return out

    monkeypatch.setattr(SpanStream, "send", logged_send)
    monkeypatch.setattr(SpanStream, "receive", logged_receive)
    # push off: the client itself sends every chunk to every server (push "auto" may let the first server pass
    # them on, by RTTs measured on a busy machine, and the client then sends the second server nothing)
    chunked = _client(swarm_, prefill_chunk_tokens=8, push="off")
    whole = _client(swarm_, prefill_chunk_tokens=0, push="off")
    try:
        results = {}
        for name, client in (("whole", whole), ("chunked", chunked)):
            events.clear()
            with client.inference_session(max_length=PROMPT_TOKENS + 3, batch_size=2) as session:
                if name == "chunked":
                    gate.update(route=[s.span.server_id for s in session.spans], chunks=math.ceil(PROMPT_TOKENS / 8))
                logits = [client.step_logits(session, ids, mask)]
                nxt = logits[0][:, -1:].argmax(-1)
                logits.append(client.step_logits(session, nxt))
                results[name] = logits
                record = session.steps[0]
                route = [s.span.server_id for s in session.spans]
                gate["route"] = None
        assert record.chunks == math.ceil(PROMPT_TOKENS / 8) and len(record.hops) == 3 * record.chunks
        real = mask.bool()  # outputs at padding positions mean nothing (fully masked attention rows)
        assert (results["chunked"][0] - results["whole"][0])[real].abs().max().item() < 1e-5
        assert (results["chunked"][1] - results["whole"][1]).abs().max().item() < 1e-5
        with torch.no_grad():
            want = ref(ids, attention_mask=mask).logits
        assert (results["chunked"][0] - want)[real].abs().max().item() < 1e-4
        # pipelining: the second server got its first chunk before the first server answered its last one
        first_send_2 = min(t for sid, kind, t in events if sid == route[1] and kind == "send")
        last_recv_1 = max(t for sid, kind, t in events if sid == route[0] and kind == "recv")
        assert first_send_2 < last_recv_1
    finally:
        chunked.close()
        whole.close()


def _count(events: list[tuple[str, str, float]], server_id: str, kind: str) -> int:
    return sum(1 for sid, k, _ in events if sid == server_id and k == kind)


@pytest.mark.slow
def test_server_dying_mid_prefill_keeps_the_logits_exact(swarm, monkeypatch):
    """The middle server is killed as the client sends the prompt's third chunk (so it cannot have answered every
    chunk yet, however fast it pushes and answers: killed on a reply's due time instead, it sometimes had): it is
    replaced and replayed; the other servers, left with chunks written but unanswered, are reopened and replayed;
    the logits do not change."""
    path, swarm_, ref = swarm
    for server in list(swarm_.servers):  # earlier tests may have killed some: every block twice again
        if not server.alive:
            swarm_.servers.remove(server)
            swarm_.start_server(BlockRange(*server.ready["blocks"]))
    ids = torch.randint(3, 500, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(1))
    client = _client(swarm_, prefill_chunk_tokens=6)
    send = SpanStream.send
    state = {"first": None, "victim": None, "seen": 0, "killed": False}

    async def killing_send(self, *args, **kwargs):
        if self.span.server_id == state["first"] and not state["killed"]:
            state["seen"] += 1
            if state["seen"] == 3:
                state["killed"] = True
                victim = next(s for s in swarm_.servers if s.server_id == state["victim"])
                swarm_.kill(victim, signal.SIGKILL)
                victim.proc.wait(60)
        return await send(self, *args, **kwargs)

    monkeypatch.setattr(SpanStream, "send", killing_send)
    try:
        with client.inference_session(max_length=PROMPT_TOKENS + 2) as session:
            state["first"], state["victim"] = session.spans[0].span.server_id, session.spans[1].span.server_id
            got = client.step_logits(session, ids)
            nxt = got[:, -1:].argmax(-1)
            got_next = client.step_logits(session, nxt)
            record = session.steps[0]
        assert state["killed"] and record.failovers == 1
        with torch.no_grad():
            want = ref(ids).logits
            want_next = ref(torch.cat([ids, nxt], 1)).logits[:, -1:]
        assert (got - want).abs().max().item() < 1e-4
        assert (got_next - want_next).abs().max().item() < 1e-4
    finally:
        client.close()


@pytest.mark.slow
def test_bandwidth_estimate_reads_a_rate_limited_link(tiny_bloom):
    """Through a real server behind a 20 Mbit/s tbf link, the client's estimate is the link's rate, not faster,
    although short prompts (whose messages pass in the shaper's burst) outnumber the long ones (the plain median
    of per-message rates read 230-350 Mbit/s on such a link in the MoLink benchmark)."""
    from swarmlm.bench.netem import LinkProfile, Testbed
    from swarmlm.config import ClientConfig

    with Testbed(1, LinkProfile(rtt_s=0.010, rate_bps=20e6), mode="namespaces") as tb, \
            LocalSwarm(tiny_bloom, with_dht=False) as local:
        port = 40490
        server = local.start_server(BlockRange(0, 6), extra=["--port", str(port)], wait=False,
                                    prefix=tb.exec_prefix(0), host=tb.host_ip(0))
        local.wait_ready([server])
        address = tb.expose(0, port)
        client = DistributedModelForCausalLM(tiny_bloom, ClientConfig(servers=(address,), prefill_chunk_tokens=0,
                                                                wire_dtype="float32"))  # the link's own rate
        try:
            gen = torch.Generator().manual_seed(0)
            # 80 tokens x 64 fp32 values each way: 40 KB per prefill (within tbf's burst); 400 tokens: 200 KB
            for length in [80] * 8 + [400] * 3:
                with client.inference_session(max_length=length + 1) as session:
                    client.step_logits(session, torch.randint(3, 500, (1, length), generator=gen))
            est = client.remote.channels.bandwidth(address)
        finally:
            client.close()
    assert est.measured
    # what the whole path delivers (gRPC, serialisation) may be below the line rate (more so on a busy machine),
    # never far above it
    assert 2e6 < est.bandwidth_bps < 24e6, est.bandwidth_bps
