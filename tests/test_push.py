"""Server-to-server push: outputs go straight to the next server, results stay exact, failures stay recoverable."""
from __future__ import annotations

import contextlib
import signal

import grpc
import pytest
import torch
from transformers import AutoTokenizer

from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.errors import InvalidRequest
from swarmlm.server.push import StepOrder, check_targets
from swarmlm.types import BlockRange
from swarmlm.wire import codec
from swarmlm.wire import swarm_pb2 as pb
from tests.swarm_helpers import (RawStream, greedy_reference, greedy_steps, in_process_server, reference_generate,
                                 reference_model, running_swarm, stub)

MAX_AHEAD = 8  # a StepOrder's bound here (ServerConfig.max_steps_ahead)

RANGES = [BlockRange(0, 2), BlockRange(2, 4), BlockRange(4, 6)]


# ---- the rules, without a network ------------------------------------------------------------------------------

def step(step_id: int) -> pb.InferenceRequest:
    return pb.InferenceRequest(step=pb.InferenceStep(step_id=step_id))


def test_step_order_takes_each_id_once_and_in_order():
    order = StepOrder(MAX_AHEAD)
    assert [r.step.step_id for r in order.admit(step(1))] == [1]
    assert order.admit(step(1)) == []  # the other copy
    assert order.admit(step(3)) == []  # ahead of its turn: held
    assert order.admit(step(3)) == []  # and its copy too
    assert [r.step.step_id for r in order.admit(step(2))] == [2, 3]
    assert order.admit(step(2)) == [] and order.last_id == 3
    assert [r.step.step_id for r in order.admit(step(0))] == [0]  # no id: arrival order, no dedup


def test_step_order_bounds_what_it_holds():
    order = StepOrder(MAX_AHEAD)
    for i in range(MAX_AHEAD):
        assert order.admit(step(i + 2)) == []
    with pytest.raises(InvalidRequest, match="ahead"):
        order.admit(step(MAX_AHEAD + 2))
    assert len(order.admit(step(1))) == MAX_AHEAD + 1


@pytest.mark.parametrize("target, message", [
    (pb.PushTarget(address="nohost", session_id="ab", step_id=1), "host:port"),
    (pb.PushTarget(address="a b:1", session_id="ab", step_id=1), "host:port"),
    (pb.PushTarget(address="h:99999", session_id="ab", step_id=1), "host:port"),
    (pb.PushTarget(address="h:1", session_id="../x", step_id=1), "session id"),
    (pb.PushTarget(address="h:1", session_id="ab", step_id=0), "nonzero"),
    (pb.PushTarget(address="h:1", session_id="ab", step_id=1, secret=b"s" * 16, push_key=b"k" * 32), "sealed push key"),
])
def test_bad_push_targets_are_refused(target, message):
    with pytest.raises(InvalidRequest, match=message):
        check_targets([target])


def test_push_targets_are_bounded():
    with pytest.raises(InvalidRequest, match="limit"):
        check_targets([pb.PushTarget(address="h:1", session_id="ab", step_id=1)] * 65)


# ---- a real swarm ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def swarm(tiny_bloom):
    # every block twice: failover has somewhere to go
    with running_swarm(tiny_bloom, RANGES + RANGES, push=True, ban_base_s=60.0) as (swarm, client):
        yield swarm, client, reference_model(tiny_bloom)


def _ids(path: str, text: str = "the quick brown fox jumps over") -> torch.Tensor:
    return AutoTokenizer.from_pretrained(path)(text, return_tensors="pt").input_ids


@pytest.mark.slow
def test_pushed_route_gives_the_local_logits_and_skips_the_client(swarm, tiny_bloom):
    _, client, ref = swarm
    ids = _ids(tiny_bloom)
    written_before = {a: l.stats.written.copy() for a, l in client.remote.channels.links.items()}
    with torch.no_grad(), client.inference_session(max_length=ids.shape[1] + 10) as session:
        assert len(session.spans) == 3
        for seen, got in greedy_steps(client, session, ids, 10):
            assert (got - ref(seen).logits[:, -got.shape[1]:]).abs().max().item() < 1e-4
        for record in session.steps:  # every server but the last pushed its output on
            assert [h.pushed for h in record.hops] == [True, True, False]
        first, later = session.spans[0].span.address, [s.span.address for s in session.spans[1:]]
    written = {a: {k: n - written_before.get(a, {}).get(k, 0) for k, n in l.stats.written.items()}
               for a, l in client.remote.channels.links.items()}
    assert sum(written[first].values()) == 11  # the client wrote only to the first server...
    assert all(sum(written.get(a, {}).values()) == 0 for a in later)  # ...never to the others


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["beam search", "prompt lookup"])
def test_cache_ops_travel_with_the_pushed_steps(swarm, tiny_bloom, mode):
    """Each server pushes its step's cache op on with its output: the client writes only to the first server, and
    the reorders / rollbacks reach every server of the route."""
    _, client, _ = swarm
    ids = _ids(tiny_bloom, "the quick brown fox the quick brown fox the")
    args = dict(num_beams=3, num_return_sequences=2) if mode == "beam search" else dict(prompt_lookup_num_tokens=3)
    want = reference_generate(tiny_bloom, ids, max_new_tokens=8, **args)
    got = client.generate(ids, max_new_tokens=8, do_sample=False, **args)
    assert torch.equal(got, want)
    for record in client.last_stats.steps:  # every server but the route's last pushed each of its replies on
        # (a step of more tokens than a prefill chunk has one reply per chunk and server, in the order they came)
        unpushed = {h.server_id for h in record.hops if not h.pushed}
        assert len(unpushed) == 1 and not any(h.pushed for h in record.hops if h.server_id in unpushed)


@pytest.mark.slow
def test_pushed_chunked_prefill_is_exact(swarm, tiny_bloom):
    _, client, ref = swarm
    ids = _ids(tiny_bloom, "one two three four five six seven eight nine ten eleven twelve")
    chunked = DistributedModelForCausalLM.from_pretrained(tiny_bloom, initial_peers=swarm[0].initial_peers,
                                                          push=True, prefill_chunk_tokens=3)
    try:
        with torch.no_grad(), chunked.inference_session(max_length=ids.shape[1] + 1) as session:
            got = chunked.step_logits(session, ids)
            assert session.steps[0].chunks > 2
            assert (got - ref(ids).logits).abs().max().item() < 1e-4
    finally:
        chunked.close()


@pytest.mark.slow
@pytest.mark.parametrize("position", [0, 1, 2])
def test_a_server_dying_on_a_pushed_route_loses_nothing(swarm, tiny_bloom, position):
    local, client, _ = swarm
    ids, want = greedy_reference(tiny_bloom, "the quick brown fox", 20)
    tokens = []
    try:
        with torch.no_grad(), client.inference_session(max_length=ids.shape[1] + 20) as session:
            logits = client.step_logits(session, ids)
            for n in range(20):
                if n == 5:
                    victim_id = session.spans[position].span.server_id
                    victim = next(s for s in local.servers if s.server_id == victim_id)
                    local.kill(victim, signal.SIGKILL)
                    victim.proc.wait(60)
                nxt = logits[:, -1:].argmax(-1)
                tokens.append(int(nxt))
                logits = client.step_logits(session, nxt)
            assert sum(r.failovers for r in session.steps) >= 1
        assert tokens == want
    finally:  # restore (also after a failure, which would else fail the next positions): every block served twice
        for server in list(local.servers):
            if not server.alive:
                local.servers.remove(server)
                local.start_server(BlockRange(*server.ready["blocks"]))


# ---- the protocol, by hand -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_servers(tiny_bloom):
    with in_process_server(tiny_bloom, RANGES[0]) as a, in_process_server(tiny_bloom, RANGES[1]) as b:
        yield a.address, b.address


def _open(address: str, blocks: BlockRange) -> tuple[RawStream, str, bytes]:
    stream, opened = RawStream.open(address, blocks.start, blocks.end)
    return stream, opened.session_id, opened.session_secret


def _step(hidden: torch.Tensor, step_id: int, push=()) -> pb.InferenceRequest:
    return pb.InferenceRequest(step=pb.InferenceStep(hidden=codec.encode(hidden), step_id=step_id, push=push))


def test_push_protocol_dedup_and_refusals(two_servers):
    a, b = two_servers
    sb = stub(b)
    call_a, _, _ = _open(a, RANGES[0])
    call_b, sid_b, secret_b = _open(b, RANGES[1])
    x = torch.randn(1, 4, 64)
    # a session nobody holds: A replies (it pushes after its reply), the push fails there, B sees nothing
    r1 = call_a.send(_step(x, 1, [pb.PushTarget(address=b, session_id="0" * 32, step_id=1, secret=b"s" * 16)]))
    assert r1.pushed and not r1.HasField("error") and r1.position == 4
    # a malformed target: refused before any compute, the session is unchanged
    r2 = call_a.send(_step(x[:, :1], 2, [pb.PushTarget(address="not an address", session_id=sid_b, step_id=1,
                                                       secret=secret_b)]))
    assert r2.HasField("error") and r2.position == 4
    # the real thing: A pushes its output into B's session; B answers on B's stream unasked
    y = torch.randn(1, 1, 64)
    r3 = call_a.send(_step(y, 3, [pb.PushTarget(address=b, session_id=sid_b, step_id=1, secret=secret_b)]))
    assert r3.pushed and r3.position == 5
    rb = call_b.read()
    assert rb.step_id == 1 and rb.position == 1  # B's first step: the failed push left nothing
    alone = sb.Forward(pb.ForwardRequest(start_block=2, end_block=4, hidden=r3.hidden))
    assert torch.allclose(codec.decode(rb.hidden, "h"), codec.decode(alone.hidden, "h"), atol=1e-5)
    # the client's own copy of step 1 is a duplicate: no reply; step 2 is answered next
    call_b.write(_step(codec.decode(r3.hidden, "h"), 1))
    rb2 = call_b.send(_step(codec.decode(r3.hidden, "h"), 2))
    assert rb2.step_id == 2 and rb2.position == 2
    # a push into a session without a stream, or without an id: refused with a status
    refusals = [(pb.PushRequest(session_id="f" * 32, step=pb.InferenceStep(step_id=1)), grpc.StatusCode.NOT_FOUND),
                (pb.PushRequest(session_id=sid_b, secret=secret_b, step=pb.InferenceStep(step_id=0)),
                 grpc.StatusCode.INVALID_ARGUMENT),
                # the id alone is not enough
                (pb.PushRequest(session_id=sid_b, step=pb.InferenceStep(step_id=3)), grpc.StatusCode.PERMISSION_DENIED)]
    for request, code in refusals:
        with pytest.raises(grpc.RpcError) as e:
            sb.Push(request)
        assert e.value.code() == code
    # a pushed step that is garbage gets an error reply on B's stream; B's session is unchanged
    sb.Push(pb.PushRequest(session_id=sid_b, secret=secret_b, step=pb.InferenceStep(
        step_id=3, hidden=pb.Tensor(data=b"xx", dtype="float32", shape=[1, 1, 64]))))
    rb3 = call_b.read()
    assert rb3.HasField("error") and rb3.step_id == 3 and rb3.position == 2
    for call in (call_a, call_b):
        call.end()


@pytest.mark.slow
def test_a_refused_push_is_sent_again_without_push_and_stays_exact(tiny_bloom):
    """The soak (issue 39) saw upstream servers whose own DHT reads failed refuse every push (they cannot see the
    next server announced), and each refusal failed the client's request. Now the client reopens the hops from the
    refusing one, sends the step itself and goes on without push: the same tokens as transformers."""
    from swarmlm.swarm.dht import visible_addrs
    from swarmlm.swarm.dht_thread import ThreadDHT

    boot = ThreadDHT(client_mode=False)
    peers = tuple(visible_addrs(boot))
    ids, want = greedy_reference(tiny_bloom, "the quick brown fox", 8)
    try:
        with in_process_server(tiny_bloom, BlockRange(0, 3), initial_peers=peers) as first, \
                in_process_server(tiny_bloom, BlockRange(3, 6), initial_peers=peers), \
                contextlib.closing(DistributedModelForCausalLM.from_pretrained(
                    tiny_bloom, initial_peers=peers, push=True)) as client, \
                torch.no_grad(), client.inference_session(max_length=ids.shape[1] + 8) as session:
            assert [s.span.server_id for s in session.spans][0] == first.server_id and len(session.spans) == 2
            first.dht.shutdown()  # the first server's DHT node is gone: it sees no one announced where it pushes
            seen, _ = list(greedy_steps(client, session, ids, 8))[-1]
            assert seen[0, ids.shape[1]:].tolist() == want
            assert session.steps[0].push_refused and session.steps[0].reopened >= 1
            assert not any(r.pushed for r in session.steps[1:])
    finally:
        boot.shutdown()


# ---- a pushed step's path: written from the step's path, taken as it arrives -----------------------------------

def test_a_decode_push_is_written_at_once_and_its_answer_read_where_it_arrives(tiny_bloom):
    """Once a target's framed port is known and a connection to it is kept, a pushing server writes a decode step's
    push from the step's own path (`Pusher.push_now`: no task, no turn on an idle link); the target takes it into
    the session's inbox and answers OK, read where the answer arrives. No known port: nothing is written (None)."""
    import asyncio

    with in_process_server(tiny_bloom, RANGES[0]) as a, in_process_server(tiny_bloom, RANGES[1]) as b:
        call_a, _, _ = _open(a.address, RANGES[0])
        call_b, sid_b, secret_b = _open(b.address, RANGES[1])
        x = torch.randn(1, 1, 64)
        target = pb.PushTarget(address=b.address, session_id=sid_b, step_id=1, secret=secret_b)
        assert call_a.send(_step(x, 1, [target])).pushed  # the first push learns b's framed port
        assert call_b.read().step_id == 1
        pusher, loop = a.service.pusher, a._tasks[0].get_loop()

        async def push_now(step_id: int, address: str):
            done = pusher.push_now(pb.PushTarget(address=address, session_id=sid_b, step_id=step_id,
                                                 secret=secret_b), codec.encode(x), pb.Tensor(), [])
            return None if done is None else await done

        assert asyncio.run_coroutine_threadsafe(push_now(2, b.address), loop).result(30) is True
        got = call_b.read()
        assert got.step_id == 2 and got.position == 2 and not got.HasField("error")
        assert asyncio.run_coroutine_threadsafe(push_now(3, "127.0.0.1:9"), loop).result(30) is None
        for call in (call_a, call_b):
            call.end()


def test_framed_pushes_written_back_to_back_are_answered_in_order(tiny_bloom):
    """Pushes are taken as their frames arrive (server/frame_server.py `_push_now`) until one would wait (the
    session's inbox full): it and every push after it go through the connection's task, in order. Each push gets
    one STATUS, in the order written, refusals included; the session answers every accepted step in order."""
    import socket

    from swarmlm.wire import frames
    from swarmlm.wire.frames import Kind, Purpose

    with in_process_server(tiny_bloom, RANGES[1], inbox_steps=2) as b:
        call_b, sid_b, secret_b = _open(b.address, RANGES[1])
        x = torch.randn(1, 1, 64)

        def push(step_id: int, secret: bytes = secret_b) -> bytes:
            request = pb.PushRequest(session_id=sid_b, secret=secret,
                                     step=pb.InferenceStep(hidden=codec.encode(x), step_id=step_id))
            return frames.frame(Kind.PUSH, request.SerializeToString())

        statuses, buf = [], bytearray()

        def read_statuses(sock, n: int) -> None:
            while len(statuses) < n:
                while (got := frames.parse_frame(buf, 1 << 16)) is None:
                    buf.extend(sock.recv(1 << 16))
                assert got[0] == Kind.STATUS
                statuses.append(frames.parse_status(got[1])[0])

        with socket.create_connection(("127.0.0.1", b.service.frame_port), timeout=60) as sock:
            # one write (one read, mostly): steps 1 and 2 fill the inbox (2) before the session's task runs, so
            # step 3 waits for room, and 4 and 5 behind it
            sock.sendall(frames.hello(Purpose.PUSH, None) + push(1) + push(2, b"w" * 16) + push(2) + push(3)
                         + push(4) + push(5))
            read_statuses(sock, 6)
            sock.sendall(push(6))  # nothing waits any more: taken as it arrives
            read_statuses(sock, 7)
        assert statuses == [grpc.StatusCode.OK, grpc.StatusCode.PERMISSION_DENIED] + [grpc.StatusCode.OK] * 5
        replies = [call_b.read() for _ in range(6)]
        assert [r.step_id for r in replies] == [1, 2, 3, 4, 5, 6] and not any(r.HasField("error") for r in replies)
        assert [r.position for r in replies] == [1, 2, 3, 4, 5, 6]
        call_b.end()
