"""Random bytes and random protobuf fields into every RPC (Inference, Forward, Backward, Info, Push), and random cache
ops and prefix-cache keys (opens, saves) into live sessions: the server stays alive, answers every call with a status
(never UNKNOWN: no exception escapes a handler), and an honest client stays exact. Seeded and bounded;
benchmarks/attacks.py runs the same fuzzer heavier."""
from __future__ import annotations

import random
from collections import Counter

import grpc
import pytest
import torch

from swarmlm.wire import codec
from tests.test_attacks import attack_server, honest, relay_bed  # noqa: F401  (fixtures: one server for this module)
from swarmlm.wire import swarm_pb2 as pb

RPCS = ("Inference", "Forward", "Backward", "Info", "Push")


def _tensor(rng: random.Random, hidden: int) -> pb.Tensor:
    dtype = rng.choice([*codec.WIRE_DTYPES, "", "complex64", "x" * 300])
    dims = [0, 1, 2, 3, 7, hidden, 2048, 1 << 31, 1 << 62, -1, -(1 << 63)]
    shape = [rng.choice(dims) for _ in range(rng.randint(0, 5))]
    size = rng.choice([0, 1, 4, 4 * hidden, 8 * hidden, rng.randint(0, 1 << 14)])
    return pb.Tensor(data=rng.randbytes(size), dtype=dtype, shape=shape)


def _target(rng: random.Random, address: str) -> pb.PushTarget:
    return pb.PushTarget(address=rng.choice([address, "127.0.0.1:1", "x" * 300, "", "[::1]:9", "10.0.0.1:80",
                                             "p2p/12D3KooWEat3ikUs8zTc2MPTy4pS4Q7UzYS5Micm32susyPnHjJX", "p2p/../x",
                                             "p2p/" + "Q" * 61]),
                         session_id=rng.choice(["", "ab", "f" * 32, "../x", "z" * 100]),
                         step_id=rng.choice([0, 1, 2, 1 << 63]), secret=rng.randbytes(rng.choice([0, 16, 17])),
                         push_key=rng.randbytes(rng.choice([0, 0, 32, 60, 61])))  # (sealed: 60 bytes)


def _mac(rng: random.Random) -> bytes:
    """A keyed session's MAC field (wire/session_keys.py): mostly absent, else random (16 bytes, or not)."""
    return rng.randbytes(rng.choice([0, 0, 16, 16, 15, 300]))


def _key_share(rng: random.Random) -> bytes:
    """An open's X25519 key share: absent (unkeyed), random, all zeros (a low-order point), or a wrong size."""
    return rng.choice([b"", b"", rng.randbytes(32), bytes(32), rng.randbytes(31), rng.randbytes(64)])


def _lora(rng: random.Random, hidden: int) -> list[pb.LoraWeights]:
    names = ["self_attention.query_key_value", "mlp.dense_4h_to_h", "", "x" * 300, "self_attention"]
    return [pb.LoraWeights(block=rng.choice([0, 1, 5, 1 << 31]), module=rng.choice(names), a=_tensor(rng, hidden),
                           b=_tensor(rng, hidden), scale=rng.choice([0.0, 2.0, -1e9, float("nan"), float("inf")]))
            for _ in range(rng.choice([0, 0, 1, 2, 3]))]


def _prompts(rng: random.Random, hidden: int) -> pb.Tensor | None:
    return _tensor(rng, hidden) if rng.random() < 0.4 else None


def _cache_op(rng: random.Random) -> pb.CacheOp | None:
    if rng.random() < 0.5:
        return None
    values = [0, 1, 2, 5, 63, 64, 1 << 31, (1 << 32) - 1]
    op = pb.CacheOp(rows=[rng.choice(values) for _ in range(rng.choice([0, 1, 2, 4, 65, 5000]))])
    if rng.random() < 0.6:
        op.truncate_to = rng.choice(values)
    return op


def _keys(rng: random.Random) -> list[bytes]:
    """Prefix-cache keys: mostly well-formed (16 bytes), some of other sizes, up to past the limit."""
    return [rng.randbytes(rng.choice([16, 16, 16, 0, 15, 17, 300])) for _ in range(rng.choice([0, 1, 3, 40, 5000]))]


def _step(rng: random.Random, hidden: int, address: str) -> pb.InferenceStep:
    return pb.InferenceStep(hidden=_tensor(rng, hidden), attention_mask=_tensor(rng, hidden) if rng.random() < 0.3
                            else None, step_id=rng.choice([0, 1, 2, 5, 1 << 63]),
                            push=[_target(rng, address) for _ in range(rng.choice([0, 0, 1, 2, 70]))],
                            cache_op=_cache_op(rng), keep_route=rng.random() < 0.3)


def _inference_request(rng: random.Random, hidden: int, blocks: int, address: str) -> pb.InferenceRequest:
    if rng.random() < 0.4:
        return pb.InferenceRequest(open=pb.OpenSession(
            start_block=rng.choice([0, 1, blocks, 1 << 31]), end_block=rng.choice([0, 1, blocks, blocks + 1]),
            batch_size=rng.choice([0, 1, 2, 64, 1 << 31]), max_length=rng.choice([0, 1, 64, 2048, 1 << 31]),
            adapter=rng.choice(["", "", "my-adapter", "x" * 300, "../etc"]),
            prefix_scope=rng.randbytes(rng.choice([0, 0, 15, 16, 64, 65])), prefix_keys=_keys(rng),
            prompts=_prompts(rng, hidden), lora=_lora(rng, hidden),  # a deep prompt, a LoRA: random
            key_share=_key_share(rng)), mac=_mac(rng))
    if rng.random() < 0.1:
        return pb.InferenceRequest(save=pb.PrefixSave(keys=_keys(rng)), mac=_mac(rng))
    return pb.InferenceRequest(session_id=rng.choice(["", "f" * 32, "x" * 500]), secret=rng.randbytes(16),
                               step=_step(rng, hidden, address), mac=_mac(rng))


def _live_session(rng: random.Random, hidden: int, blocks: int) -> list[pb.InferenceRequest]:
    """A real session (open, a prefill of up to 3 rows) then steps of well-formed tensors with random cache ops."""
    rows, tokens = rng.randint(1, 3), rng.randint(1, 40)
    scope = rng.choice([b"", b"s" * 16, rng.randbytes(16)])  # b"s" * 16: sessions of one scope may meet
    deep = rng.random() < 0.3  # a well-formed deep prompt (then no prefix cache: that open would be refused)
    prompts = codec.encode(torch.randn(blocks, rng.randint(1, 48), hidden)) if deep else None
    requests = [pb.InferenceRequest(open=pb.OpenSession(start_block=0, end_block=blocks, batch_size=rng.randint(1, 4),
                                                        max_length=48, prefix_scope=b"" if deep else scope,
                                                        prefix_keys=[] if deep else
                                                        [bytes([k]) * 16 for k in range(3)], prompts=prompts)),
                pb.InferenceRequest(step=pb.InferenceStep(hidden=codec.encode(torch.randn(rows, tokens, hidden))))]
    for _ in range(rng.randint(1, 4)):
        shape = (rng.choice([1, 2, 3, 4, 5]), rng.choice([1, 1, 2, 12]), hidden)
        requests.append(pb.InferenceRequest(step=pb.InferenceStep(hidden=codec.encode(torch.randn(shape)),
                                                                  cache_op=_cache_op(rng))))
    if rng.random() < 0.5:  # keep a prefix (well-formed keys, maybe more runs than it holds)
        keys = [bytes([k]) * 16 for k in range(rng.randint(0, 3))]
        requests.append(pb.InferenceRequest(save=pb.PrefixSave(keys=keys)))
    return requests


def _call(channel: grpc.Channel, rng: random.Random, rpc: str, hidden: int, blocks: int, address: str) -> str:
    raw = rng.random() < 0.3  # random bytes instead of a message
    path = f"/swarmlm.Swarm/{rpc}"
    kind = "raw " if raw else ""
    try:
        if rpc == "Inference":
            if raw:
                requests = [rng.randbytes(rng.randint(0, 256)) for _ in range(rng.randint(1, 3))]
                call = channel.stream_stream(path)(iter(requests), timeout=30)
            else:
                requests = (_live_session(rng, hidden, blocks) if rng.random() < 0.3 else
                            [_inference_request(rng, hidden, blocks, address) for _ in range(rng.randint(1, 4))])
                call = channel.stream_stream(path, request_serializer=pb.InferenceRequest.SerializeToString,
                                             response_deserializer=pb.InferenceReply.FromString)(
                    iter(requests), timeout=30)
            for _ in call:  # the stream ends cleanly after the last request: its session (if any) closes
                pass
            return kind + "OK"
        if raw:
            channel.unary_unary(path)(rng.randbytes(rng.randint(0, 512)), timeout=30)
            return kind + "OK"
        if rpc == "Forward":
            msg = pb.ForwardRequest(start_block=rng.choice([0, 1, blocks]), end_block=rng.choice([0, blocks, 99]),
                                    hidden=_tensor(rng, hidden),
                                    attention_mask=_tensor(rng, hidden) if rng.random() < 0.3 else None,
                                    prompts=_prompts(rng, hidden), lora=_lora(rng, hidden))
            reply_type = pb.ForwardReply
        elif rpc == "Backward":
            x = codec.encode(torch.randn(rng.choice([1, 2]), rng.choice([1, 3]), hidden))
            msg = pb.BackwardRequest(start_block=rng.choice([0, 1, blocks]), end_block=rng.choice([0, blocks, 99]),
                                     hidden=x if rng.random() < 0.5 else _tensor(rng, hidden),
                                     grad_output=x if rng.random() < 0.3 else _tensor(rng, hidden),
                                     attention_mask=_tensor(rng, hidden) if rng.random() < 0.3 else None,
                                     prompts=_prompts(rng, hidden), lora=_lora(rng, hidden))
            reply_type = pb.BackwardReply
        elif rpc == "Push":
            msg = pb.PushRequest(session_id=rng.choice(["", "f" * 32]), secret=rng.randbytes(16),
                                 step=_step(rng, hidden, address), mac=_mac(rng))
            reply_type = pb.PushReply
        else:
            msg = pb.InfoRequest()
            reply_type = pb.InfoReply
        channel.unary_unary(path, request_serializer=type(msg).SerializeToString,
                            response_deserializer=reply_type.FromString)(msg, timeout=30)
        return "OK"
    except grpc.RpcError as exc:
        return kind + exc.code().name


def fuzz_all(address: str, count: int, seed: int, hidden: int, blocks: int) -> Counter:
    """`count` random calls spread over every RPC; the status codes they got ("raw X": random bytes got X)."""
    rng = random.Random(seed)
    codes: Counter = Counter()
    with grpc.insecure_channel(address) as channel:
        for i in range(count):
            codes[_call(channel, rng, RPCS[i % len(RPCS)], hidden, blocks, address)] += 1
    return codes


@pytest.mark.slow
def test_fuzzing_every_rpc_leaves_the_server_serving_exactly(attack_server, honest):
    address, hidden, blocks = attack_server
    codes = fuzz_all(address, count=240, seed=14, hidden=hidden, blocks=blocks)
    assert sum(codes.values()) == 240
    # every refusal is a deliberate status: an exception escaping a handler would be UNKNOWN, and so would bytes
    # that do not parse if gRPC parsed them itself (the service parses them: INVALID_ARGUMENT)
    deliberate = {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED"}
    assert set(codes) <= deliberate | {"raw " + c for c in deliberate}, codes
    assert honest.poll_correct()  # the server is alive and computes exactly


def fuzz_frames(address: str, count: int, seed: int, hidden: int, blocks: int) -> Counter:
    """`count` connections to the framed step port, each with random frames (wire/frames.py): what each ended with
    ("STATUS CODE" or "closed")."""
    from swarmlm.bench import frame_attacks as fa

    rng = random.Random(seed)
    host, port = address.rsplit(":", 1)[0], fa.frame_port(address)
    ends: Counter = Counter()
    for _ in range(count):
        answers = fa.exchange(host, port, fa.random_frames(rng, hidden, blocks), half_close=True)
        ends[" ".join(answers[-1].split()[:2])] += 1
    return ends


@pytest.mark.slow
def test_fuzzing_the_framed_port_leaves_the_server_serving_exactly(attack_server, honest):
    address, hidden, blocks = attack_server
    ends = fuzz_frames(address, count=120, seed=40, hidden=hidden, blocks=blocks)
    assert sum(ends.values()) == 120
    # a deliberate status or a close (a connection cut inside a frame), never INTERNAL or UNKNOWN
    deliberate = {"STATUS OK", "STATUS INVALID_ARGUMENT", "STATUS NOT_FOUND", "STATUS PERMISSION_DENIED",
                  "STATUS RESOURCE_EXHAUSTED", "closed"}
    assert set(ends) <= deliberate, ends
    assert honest.poll_correct()


def _mutate(body: bytearray, rng: random.Random) -> None:
    """A frame body with 1-4 random bytes changed (half the time), cut short, or grown by 1-64 random bytes."""
    pick = rng.random()
    if pick < 0.5:
        for _ in range(rng.randint(1, 4)):
            body[rng.randrange(len(body))] = rng.randrange(256)
    elif pick < 0.75:
        del body[rng.randrange(len(body)):]
    else:
        body += rng.randbytes(rng.randint(1, 64))


def fuzz_compact(address: str, count: int, seed: int, hidden: int, blocks: int, good: int = 0) -> Counter:
    """`count` keyed sessions, each sent `good` good STEPs, then a compact STEP (wire/compact.py) with random bytes
    changed, cut or added (its header, values or MAC), then END: what each ended with ("STATUS CODE" or "closed")."""
    from swarmlm.bench import frame_attacks as fa
    from swarmlm.wire import frames

    rng = random.Random(seed)
    ends: Counter = Counter()
    for _ in range(count):
        with fa.KeyedStream(address, blocks) as stream:
            for step_id in range(1, good + 1):
                stream.step(fa._values(1, 1, hidden), step_id)
            frame = bytearray(stream.step_frame(fa._values(1, 1, hidden), good + 1))
            body = frame[frames.HEADER.size:]
            _mutate(body, rng)
            answers = stream.exchange(frames.frame(frames.Kind.STEP, bytes(body)) + fa.END)
        ends[" ".join(answers[-1].split()[:2])] += 1
    return ends


@pytest.mark.parametrize("good", [0, 2], ids=["first step", "on an armed step lane"])
def test_fuzzing_compact_steps_closes_or_refuses_each_and_the_server_serves_on(attack_server, honest, good):
    """(After 2 good steps a lone session's step lane is armed, server/lane.py: the changed STEP meets it first.)"""
    address, hidden, blocks = attack_server
    ends = fuzz_compact(address, count=40, seed=17, hidden=hidden, blocks=blocks, good=good)
    assert sum(ends.values()) == 40
    # a changed STEP is a tampered one (its MAC): the session closed; never INTERNAL or UNKNOWN
    assert set(ends) <= {"STATUS PERMISSION_DENIED", "STATUS INVALID_ARGUMENT", "STATUS OK"}, ends
    assert ends["STATUS PERMISSION_DENIED"] > 0, ends
    assert honest.poll_correct()


def fuzz_pushes(address: str, count: int, seed: int, hidden: int, blocks: int) -> tuple[Counter, Counter]:
    """`count` keyed sessions, each pushed a compact PUSH_STEP (wire/compact.py) with random bytes changed, cut or
    added (its session id, secret, header, values or MAC) on a push connection: what each push was answered
    ("REFUSED CODE", or "taken": no answer), and what each session's stream ended with after its END ("STATUS CODE"
    or "closed")."""
    from swarmlm.bench import frame_attacks as fa
    from swarmlm.wire import compact, frames

    rng = random.Random(seed)
    pushes: Counter = Counter()
    streams: Counter = Counter()
    host, port = address.rsplit(":", 1)[0], fa.frame_port(address)
    for _ in range(count):
        with fa.KeyedStream(address, blocks) as stream:
            values = fa._values(1, 1, hidden)
            frame = compact.push_frame(stream.keys.push, stream.session_id, stream.secret, 1, 1, 1, hidden,
                                       values.tobytes())
            body = bytearray(frame[frames.HEADER.size:])
            _mutate(body, rng)
            with fa.KeyedStream.plain(host, port) as pusher:
                answers = pusher.exchange(fa.PUSH_HELLO + frames.frame(frames.Kind.PUSH_STEP, bytes(body)))
            # "REFUSED CODE" for a refusal, "taken" for a push taken (not answered), else how the connection ended
            first = answers[0].split() if answers else ["closed"]
            pushes["taken" if first == ["closed"] else " ".join(first[:1] + first[2:3])] += 1
            streams[" ".join(stream.exchange(fa.END)[-1].split()[:2])] += 1
    return pushes, streams


def test_fuzzing_compact_pushes_refuses_each_and_the_server_serves_on(attack_server, honest):
    address, hidden, blocks = attack_server
    pushes, streams = fuzz_pushes(address, count=40, seed=23, hidden=hidden, blocks=blocks)
    assert sum(pushes.values()) == 40 and sum(streams.values()) == 40
    # a changed push is refused by a REFUSED (its MAC, its secret, its session) or, if only its values' length no
    # longer matches, taken and refused by the session's step; never INTERNAL or UNKNOWN; every session ends cleanly
    assert set(pushes) <= {"REFUSED PERMISSION_DENIED", "REFUSED NOT_FOUND", "taken"}, pushes
    assert pushes["REFUSED PERMISSION_DENIED"] > 0, pushes
    assert set(streams) == {"STATUS OK"}, streams
    assert honest.poll_correct()


@pytest.mark.slow
def test_fuzzing_the_relay_leaves_it_relaying(relay_bed):
    """Random bytes and malformed headers into every relay protocol (swarm/relay.py): each stream gets an ERR or
    is closed, never an OK it should not get; the honest client still gets through."""
    from swarmlm.bench import relay_attacks as ra

    for seed in range(2):
        answers = relay_bed.attack(ra.garbage, 30, seed)
        assert all(a == "closed" or a.startswith(("ERR", "refused")) for a in answers), answers
    assert relay_bed.honest_roundtrip()
