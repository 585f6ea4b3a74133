"""Every attack of issue 14 (resources part) replayed heavy against a real server process, with an honest client.

Per attack: the server stays alive, the honest client's greedy tokens equal plain transformers' after the attack
(polled: the time to recover is from the attack's end to the first correct generation), the server's RSS before,
after and at its peak (psutil, sampled every 20 ms). The table goes to docs/FAILURES.md and docs/RESULTS.md.

    .venv/bin/python benchmarks/attacks.py [--only NAME ...] [--model tiny-bloom]
    .venv/bin/python benchmarks/attacks.py --gateway [--only NAME ...]   # the gateway's (benchmarks/gateway_attacks.py)
    .venv/bin/python benchmarks/attacks.py --relay     # the relay's (servers behind NAT, swarmlm/bench/relay_attacks.py)
    .venv/bin/python benchmarks/attacks.py --swarm [--only NAME ...]   # a swarm's (swarmlm/bench/swarm_attacks.py)

The light versions of the same cases run in tests/test_attacks.py, tests/test_fuzz_rpc.py and
tests/test_api_hostile.py.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from swarmlm.bench.raw_stream import RawStream, greedy_tokens, open_request  # noqa: E402
from swarmlm.bench.telemetry import RssSampler  # noqa: E402
from swarmlm.machine import machine_info  # noqa: E402
from swarmlm.model.random_checkpoint import init_checkpoint  # noqa: E402
from swarmlm.swarm.local import LocalSwarm  # noqa: E402
from swarmlm.types import BlockRange  # noqa: E402
from swarmlm.wire import codec  # noqa: E402
from swarmlm.wire import swarm_pb2 as pb  # noqa: E402
from swarmlm.wire import swarm_pb2_grpc as pb_grpc  # noqa: E402
from swarmlm.wire.channel import sync_channel  # noqa: E402

MB = 1 << 20
PROMPT = "the quick brown fox jumps over"
NEW_TOKENS = 8


@dataclass
class Outcome:
    attack: str
    tried: int  # requests / streams the attack sent
    alive: bool
    honest_correct: bool
    rss_before_mb: float
    rss_after_mb: float
    rss_peak_mb: float
    recover_s: float  # attack end -> first correct honest generation
    note: str = ""


class Honest:
    """A client of the swarm generating greedily; its tokens are compared with plain transformers'."""

    def __init__(self, model_dir: str, address: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from swarmlm.client.model import DistributedModelForCausalLM

        self.ids = AutoTokenizer.from_pretrained(model_dir)(PROMPT, return_tensors="pt").input_ids
        ref = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        with torch.no_grad():
            self.want = ref.generate(self.ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                     do_sample=False)[0, self.ids.shape[1]:].tolist()
        self.client = DistributedModelForCausalLM.from_pretrained(model_dir, servers=[address], ban_base_s=0.1,
                                                                  ban_max_s=0.2, step_timeout_s=60.0)

    def tokens(self, step_latencies: list[float] | None = None) -> list[int]:
        return greedy_tokens(self.client, self.ids, NEW_TOKENS, step_latencies)

    def correct(self) -> bool:
        try:
            return self.tokens() == self.want
        except Exception:
            return False

    def recover(self, deadline_s: float = 120.0) -> float:
        """Seconds until a generation is correct (inf if never within the deadline)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < deadline_s:
            if self.correct():
                return time.monotonic() - t0
            time.sleep(0.2)
        return float("inf")


def stub(address: str, max_mb: int = 256) -> tuple[grpc.Channel, pb_grpc.SwarmStub]:
    channel = sync_channel(address, max_mb * MB)
    return channel, pb_grpc.SwarmStub(channel)


# ---- the attacks: each returns how many requests it sent and a note --------------------------------------------

def _open_many(ctx, count: int, garbage: bool) -> tuple[grpc.Channel, list, int]:
    """`count` session opens from one host, each followed by a garbage step if asked: (channel, streams, refused)."""
    channel, st = stub(ctx.address)
    streams, refused = [], 0
    for _ in range(count):
        s = RawStream(st, timeout_s=600)
        try:
            s.send(open_request(0, ctx.blocks, max_length=64))
            if garbage:
                s.send(pb.InferenceRequest(step=pb.InferenceStep(
                    hidden=pb.Tensor(data=os.urandom(40), dtype="float32", shape=[1, 1, 10]))))
            streams.append(s)
        except grpc.RpcError:
            refused += 1
    return channel, streams, refused


def slot_exhaustion(ctx) -> tuple[int, str]:
    """64 opens, a garbage step on each, then every stream dropped (as a client that dies)."""
    channel, streams, refused = _open_many(ctx, 64, garbage=True)
    for s in streams:
        s.drop()
    channel.close()
    return 64, f"{refused} opens refused (per-peer quota)"


def silent_opens(ctx) -> tuple[int, str]:
    """64 opens held open without a step; the honest client is polled while they are still held."""
    channel, streams, refused = _open_many(ctx, 64, garbage=False)
    ctx.hold = (channel, streams)  # released after the recovery poll
    return 64, f"{refused} opens refused (per-peer quota); the rest held during the poll"


def big_reservations(ctx) -> tuple[int, str]:
    """2 opens of batch 64 x 2048 tokens (and 2 of 16 x 2048 that fit the cache), held without a step."""
    channel, st = stub(ctx.address)
    streams, refused = [], 0
    for batch in (64, 64, 16, 16):
        s = RawStream(st, timeout_s=600)
        try:
            s.send(open_request(0, ctx.blocks, batch=batch, max_length=2048))
            streams.append(s)
        except grpc.RpcError:
            refused += 1
    ctx.hold = (channel, streams)
    return 4, f"{refused} of 4 refused at open (more than a host's share of the cache); none reserves cache before a step"


def oversized_loop(ctx, concurrent: int = 1, count: int = 24) -> tuple[int, str]:
    """`count` Forward messages of 61 MiB that the server refuses, `concurrent` at a time."""
    channel, st = stub(ctx.address)
    tokens = (61 * MB) // (4 * ctx.hidden)
    msg = pb.ForwardRequest(start_block=0, end_block=ctx.blocks, hidden=pb.Tensor(
        data=bytes(tokens * ctx.hidden * 4), dtype="float32", shape=[1, tokens, ctx.hidden]))
    codes: dict[str, int] = {}

    def one() -> None:
        try:
            st.Forward(msg, timeout=120)
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name
        codes[code] = codes.get(code, 0) + 1

    for start in range(0, count, concurrent):
        threads = [threading.Thread(target=one) for _ in range(min(concurrent, count - start))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    channel.close()
    return count, ", ".join(f"{n} x {c}" for c, n in sorted(codes.items()))


def oversized_concurrent(ctx) -> tuple[int, str]:
    return oversized_loop(ctx, concurrent=16, count=16)


def big_forward(ctx) -> tuple[int, str]:
    """One valid Forward of B=16 x 2048 tokens while the honest client decodes: its slowest step is reported."""
    channel, st = stub(ctx.address)
    x = torch.randn(16, 2048, ctx.hidden)
    result: dict = {}

    def forward() -> None:
        t0 = time.perf_counter()
        try:
            st.Forward(pb.ForwardRequest(start_block=0, end_block=ctx.blocks, hidden=codec.encode(x)), timeout=600)
            result["code"] = "OK"
        except grpc.RpcError as exc:
            result["code"] = exc.code().name
        result["s"] = time.perf_counter() - t0

    t = threading.Thread(target=forward)
    t.start()
    time.sleep(0.5)  # the Forward is in the server
    latencies: list[float] = []
    steps_ok = ctx.honest.tokens(latencies) == ctx.honest.want
    t.join()
    channel.close()
    return 1, (f"Forward {result.get('code')} in {result.get('s', 0):.1f} s; honest session during it: "
               f"{'correct' if steps_ok else 'WRONG'}, slowest decode step {max(latencies):.2f} s")


def stranger(ctx) -> tuple[int, str]:
    """A stranger who knows a live session's id pushes into it, resumes it, and ends the resumed stream (close)."""
    channel, st = stub(ctx.address)
    owner = RawStream(st, timeout_s=600)
    opened = owner.send(open_request(0, ctx.blocks, max_length=64))
    sid = opened.session_id
    x, y = torch.randn(1, 3, ctx.hidden), torch.randn(1, 1, ctx.hidden)
    owner.send(pb.InferenceRequest(step=pb.InferenceStep(hidden=codec.encode(x), step_id=1)))
    codes = []
    for attempt in range(20):
        try:
            st.Push(pb.PushRequest(session_id=sid, secret=os.urandom(16), step=pb.InferenceStep(
                hidden=codec.encode(torch.randn(1, 1, ctx.hidden)), step_id=2)), timeout=10)
            codes.append("OK")
        except grpc.RpcError as exc:
            codes.append(exc.code().name)
        s = RawStream(st, timeout_s=600)
        try:
            s.send(pb.InferenceRequest(session_id=sid, secret=os.urandom(16), step=pb.InferenceStep(
                hidden=codec.encode(y), step_id=2)))
            codes.append("OK")
        except grpc.RpcError as exc:
            codes.append(exc.code().name)
        s.end()
    got = owner.send(pb.InferenceRequest(step=pb.InferenceStep(hidden=codec.encode(y), step_id=2)))
    fresh = RawStream(st, timeout_s=600)
    fresh.send(open_request(0, ctx.blocks, max_length=64))
    fresh.send(pb.InferenceRequest(step=pb.InferenceStep(hidden=codec.encode(x))))
    want = fresh.send(pb.InferenceRequest(step=pb.InferenceStep(hidden=codec.encode(y))))
    same = torch.equal(codec.decode(got.hidden), codec.decode(want.hidden)) and got.position == 4
    for s in (owner, fresh):
        s.end()
    channel.close()
    accepted = codes.count("OK")
    return len(codes), f"{accepted} of {len(codes)} accepted; owner's output unchanged: {same}"


def zero_element(ctx) -> tuple[int, str]:
    """Zero-element tensors with huge dims, to Forward and into a session; the session must not leak."""
    channel, st = stub(ctx.address)
    before = st.Info(pb.InfoRequest()).active_sessions
    shapes = [[0, 1 << 40, ctx.hidden], [0, 1 << 62, 1 << 62], [1 << 31, 0, 1 << 40], [0, 0, 0]]
    codes = []
    for shape in shapes:
        try:
            st.Forward(pb.ForwardRequest(start_block=0, end_block=ctx.blocks,
                                         hidden=pb.Tensor(dtype="float32", shape=shape)), timeout=10)
            codes.append("OK")
        except grpc.RpcError as exc:
            codes.append(exc.code().name)
        s = RawStream(st, timeout_s=600)
        s.send(open_request(0, ctx.blocks, max_length=64))
        reply = s.send(pb.InferenceRequest(step=pb.InferenceStep(hidden=pb.Tensor(dtype="float32", shape=shape))))
        codes.append("error reply" if reply.HasField("error") else "OK")
        s.end()
    deadline = time.monotonic() + 30
    while st.Info(pb.InfoRequest()).active_sessions != before and time.monotonic() < deadline:
        time.sleep(0.1)
    leaked = st.Info(pb.InfoRequest()).active_sessions - before
    channel.close()
    return len(codes), f"{', '.join(sorted(set(codes)))}; sessions leaked: {leaked}"


def cache_ops(ctx, rounds: int = 200) -> tuple[int, str]:
    """Hostile cache ops into a live session (truncations past what it holds, rows out of range or past the batch
    reserved at open, 5000-row lists), between legal ones that copy one row to the 16 reserved and roll back."""
    channel, st = stub(ctx.address)
    s = RawStream(st, timeout_s=600)
    s.send(open_request(0, ctx.blocks, batch=16, max_length=64))
    s.send(pb.InferenceRequest(step=pb.InferenceStep(hidden=codec.encode(torch.randn(1, 8, ctx.hidden)))))
    hostile = [pb.CacheOp(truncate_to=(1 << 32) - 1), pb.CacheOp(rows=[1 << 31]), pb.CacheOp(rows=[0] * 17),
               pb.CacheOp(rows=[0] * 5000), pb.CacheOp(truncate_to=0, rows=[0])]
    refused = legal = 0
    rng = random.Random(0)
    for i in range(rounds):
        if i % 2:
            op, rows = hostile[rng.randrange(len(hostile))], 1
        else:  # legal: back to the 8 prompt tokens, one row copied to all 16
            op, rows = pb.CacheOp(truncate_to=8, rows=[0] * 16), 16
        reply = s.send(pb.InferenceRequest(step=pb.InferenceStep(
            hidden=codec.encode(torch.randn(rows, 1, ctx.hidden)), cache_op=op)))
        refused += reply.HasField("error")
        legal += not reply.HasField("error")
        if not reply.HasField("error"):  # back to 1 row for the next hostile op
            s.send(pb.InferenceRequest(step=pb.InferenceStep(hidden=codec.encode(torch.randn(1, 1, ctx.hidden)),
                                                             cache_op=pb.CacheOp(truncate_to=8, rows=[0]))))
    s.end()
    channel.close()
    return rounds, f"{refused} hostile refused, {legal} legal applied"


def prefix_flood(ctx, sessions: int = 24, tokens: int = 256) -> tuple[int, str]:
    """Sessions that each keep a 256-token prefix under fresh random scopes and keys (more than the prefix budget
    holds), plus saves that do not fit the session: the budget holds, the honest client's own scope sees none."""
    channel, st = stub(ctx.address)
    refused = 0
    for i in range(sessions):
        s = RawStream(st, timeout_s=600)
        keys = [random.randbytes(16) for _ in range(tokens // 16)]
        s.send(pb.InferenceRequest(open=pb.OpenSession(start_block=0, end_block=ctx.blocks, batch_size=1,
                                                       max_length=tokens + 1, prefix_scope=random.randbytes(16),
                                                       prefix_keys=keys)))
        s.send(pb.InferenceRequest(step=pb.InferenceStep(hidden=codec.encode(torch.randn(1, tokens, ctx.hidden)))))
        refused += s.send(pb.InferenceRequest(save=pb.PrefixSave(keys=keys + keys[:1]))).HasField("error")
        s.write(pb.InferenceRequest(save=pb.PrefixSave(keys=keys)))
        s.end()
        list(s.replies)  # the clean end, after the save
    info = st.Info(pb.InfoRequest()).prefix_cache
    channel.close()
    return sessions, (f"{refused} oversized saves refused; held {info.bytes / MB:.1f} of {info.limit_bytes / MB:.0f} "
                      f"MiB in {info.entries} entries, {info.evictions} evicted")


def fuzz(ctx, count: int = 2000, seed: int = 0) -> tuple[int, str]:
    """Random bytes and random protobuf fields into every RPC."""
    from tests.test_fuzz_rpc import fuzz_all  # one fuzzer, light in the tests and heavy here

    codes = fuzz_all(ctx.address, count, seed, ctx.hidden, ctx.blocks)
    return count, ", ".join(f"{n} x {c}" for c, n in sorted(codes.items()))


def hostile_training(ctx, rounds: int = 20) -> tuple[int, str]:
    """Malformed and oversized gradients, prompts and LoRA to Backward / Forward (issue 27), `rounds` times each."""
    from tests.test_attacks import hostile_training_requests  # one list of cases, light in the tests

    channel, st = stub(ctx.address)
    codes: dict[str, int] = {}
    cases = hostile_training_requests(ctx.hidden, ctx.blocks)
    for _ in range(rounds):
        for _, request in cases:
            call = st.Backward if isinstance(request, pb.BackwardRequest) else st.Forward
            try:
                call(request, timeout=60)
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            codes[code] = codes.get(code, 0) + 1
    channel.close()
    return rounds * len(cases), ", ".join(f"{n} x {c}" for c, n in sorted(codes.items()))


def hostile_tuned_opens(ctx, rounds: int = 20) -> tuple[int, str]:
    """Deep prompts (OpenSession.prompts) of wrong blocks, lengths, widths, dtypes, values or sizes, a client's
    LoRA (OpenSession.lora) a training request could not carry, each also beside a prefix scope, `rounds` times
    each: every open refused, no session left behind."""
    from tests.test_attacks import hostile_tuned_opens as cases_of  # one list of cases, light in the tests

    channel, st = stub(ctx.address)
    before = st.Info(pb.InfoRequest()).active_sessions
    codes: dict[str, int] = {}
    cases = cases_of(ctx.hidden, ctx.blocks)
    for _ in range(rounds):
        for _, request in cases:
            s = RawStream(st, timeout_s=60)
            try:
                s.send(request)
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            s.drop()
            codes[code] = codes.get(code, 0) + 1
    deadline = time.monotonic() + 30
    while st.Info(pb.InfoRequest()).active_sessions != before and time.monotonic() < deadline:
        time.sleep(0.1)
    leaked = st.Info(pb.InfoRequest()).active_sessions - before
    channel.close()
    return rounds * len(cases), ", ".join(f"{n} x {c}" for c, n in sorted(codes.items())) + f"; sessions leaked: {leaked}"


def training_flood(ctx, calls: int = 32, rows: int = 64, tokens: int = 128) -> tuple[int, str]:
    """`calls` concurrent Backwards of rows x tokens, each within the per-request bound (issue 39, hole 2): their sum
    is bounded by the server's training budget (--max-train-total-mb), the rest wait or are refused."""
    x, g = torch.randn(rows, tokens, ctx.hidden), torch.randn(rows, tokens, ctx.hidden)
    request = pb.BackwardRequest(start_block=0, end_block=ctx.blocks, hidden=codec.encode(x),
                                 grad_output=codec.encode(g))
    codes: dict[str, int] = {}

    def one(_: int) -> None:
        channel, st = stub(ctx.address)
        try:
            st.Backward(request, timeout=600)
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name
        finally:
            channel.close()
        codes[code] = codes.get(code, 0) + 1

    threads = [threading.Thread(target=one, args=(i,)) for i in range(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return calls, ", ".join(f"{n} x {c}" for c, n in sorted(codes.items()))


FRAME_ROUND_S = 2.0  # hostile_frames' rounds take at least this long


def hostile_frames(ctx, rounds: int = 20, random_count: int = 1000) -> tuple[int, str]:
    """The framed step port (wire/frames.py): every hostile case (garbage, wrong magic, oversized, truncated,
    interleaved, unparsable; compact STEPs tampered, cut, out of bounds, not finite, out of place; compact pushes
    tampered, cut, in another MAC domain, unknown, replayed, interleaved, out of place) `rounds` times,
    then `random_count` connections of random frames."""
    from swarmlm.bench import frame_attacks as fa
    from tests.test_fuzz_rpc import fuzz_frames

    wrong = 0
    for _ in range(rounds):
        started = time.monotonic()
        answers = fa.run_cases(ctx.address, ctx.hidden, ctx.blocks, 64 * MB)
        wrong += sum(not fa.expected(name, got) for name, got in answers.items())
        answers = fa.run_compact_cases(ctx.address, ctx.hidden, ctx.blocks)  # compact STEPs (wire/compact.py)
        wrong += sum(not fa.compact_expected(name, got) for name, got in answers.items())
        answers = fa.run_push_cases(ctx.address, ctx.hidden, ctx.blocks)  # compact pushes (PUSH_STEP)
        wrong += sum(not fa.push_expected(name, *got) for name, got in answers.items())
        # a round's broken streams leave 8 sessions detached for the server's resume grace (5 s): at most 3 rounds'
        # worth at once stays under the per-peer session limit (32), whose refusal is not what is tested here
        time.sleep(max(0.0, FRAME_ROUND_S - (time.monotonic() - started)))
    ends = fuzz_frames(ctx.address, random_count, 0, ctx.hidden, ctx.blocks)
    cases = rounds * (len(fa.cases(ctx.hidden, ctx.blocks, 64 * MB)) + len(fa.compact_cases(ctx.hidden))
                      + len(fa.push_cases(ctx.hidden)))
    return cases + random_count, (f"{cases - wrong}/{cases} cases refused as expected; random: "
                                  + ", ".join(f"{n} x {c}" for c, n in sorted(ends.items())))


ATTACKS: dict[str, Callable] = {
    "slot exhaustion (64 opens + garbage, dropped)": slot_exhaustion,
    "silent opens (64 held, no step)": silent_opens,
    "big reservations (2 x 64x2048 + 2 x 16x2048)": big_reservations,
    "oversized loop (24 x 61 MiB Forward)": oversized_loop,
    "oversized at once (16 x 61 MiB Forward)": oversized_concurrent,
    "big Forward (B=16 x 2048)": big_forward,
    "stranger push / resume / close": stranger,
    "zero-element huge dims": zero_element,
    "hostile cache ops (200 steps, copies to 16 rows)": cache_ops,
    "prefix flood (24 x 256-token saves, random scopes)": prefix_flood,
    "fuzz (random bytes + fields, every RPC)": fuzz,
    "hostile training requests (gradients, prompts, LoRA)": hostile_training,
    "training flood (32 concurrent Backwards of 64 x 128)": training_flood,
    "hostile deep prompts and LoRAs at open (each bad open x 20)": hostile_tuned_opens,
    "hostile frames (framed step port: each case x 20 + 1000 random)": hostile_frames,
}


class Context:
    def __init__(self, address: str, hidden: int, blocks: int, honest: Honest) -> None:
        self.address, self.hidden, self.blocks, self.honest = address, hidden, blocks, honest
        self.hold = None


def run(model_dir: str, only: list[str], threads: int) -> list[Outcome]:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    blocks, hidden = int(cfg.num_hidden_layers), int(cfg.hidden_size)
    outcomes = []
    with LocalSwarm(model_dir, threads=threads, with_dht=False,
                    server_args=["--open-idle-timeout", "10", "--resume-grace", "5", "--prefix-cache-mb", "1"]) as swarm:
        server = swarm.start_server(BlockRange(0, blocks))
        honest = Honest(model_dir, server.address)
        assert honest.correct(), "the honest client is wrong before any attack"
        for name, attack in ATTACKS.items():
            if only and not any(o in name for o in only):
                continue
            ctx = Context(server.address, hidden, blocks, honest)
            with RssSampler(server.proc.pid) as rss:
                before = rss.rss()
                tried, note = attack(ctx)
                recover = honest.recover()
                if ctx.hold is not None:  # attacks that hold streams let go only now
                    channel, streams = ctx.hold
                    for s in streams:
                        s.drop()
                    channel.close()
                time.sleep(1.0)
                after = rss.rss()
            outcome = Outcome(name, tried, server.alive, recover != float("inf"), before / MB, after / MB,
                              rss.peak / MB, recover, note)
            print(json.dumps(asdict(outcome)), flush=True)
            outcomes.append(outcome)
        honest.client.close()
    return outcomes


def table(outcomes: list[Outcome]) -> str:
    lines = ["| attack | tried | server alive | honest client correct | RSS before / after / peak (MB) | "
             "recovered after | notes |", "|---|---|---|---|---|---|---|"]
    for o in outcomes:
        lines.append(f"| {o.attack} | {o.tried} | {'yes' if o.alive else 'NO'} | "
                     f"{'yes' if o.honest_correct else 'NO'} | {o.rss_before_mb:.0f} / {o.rss_after_mb:.0f} / "
                     f"{o.rss_peak_mb:.0f} | {o.recover_s:.1f} s | {o.note} |")
    return "\n".join(lines)


def relay_run() -> list[dict]:
    """The relay's attacks, heavy (swarmlm/bench/relay_attacks.py): each answer counted; the relay's RSS and the
    honest client's round trip after each."""
    from collections import Counter

    from swarmlm.bench import relay_attacks as ra

    heavy = [("header flood (64 streams x 1 MiB)", ra.header_flood, 64), ("garbage (600 streams)", ra.garbage, 600),
             ("dial unknown servers (64)", ra.dial_unknown, 64), ("guessed cookies (256)", ra.guess_cookies, 256),
             ("circuit exhaustion by one peer (cap + 32)", ra.exhaust_circuits, 32),
             ("an idle circuit", ra.idle_circuit, None), ("aimed dial-backs", ra.aim_dialback, None),
             ("LISTEN, then 1 GiB of bytes", ra.listen_flood, 1 << 30),
             ("no / wrong / replayed tokens", ra.tokens_without_key, None)]
    results = []
    with ra.RelayBed(swarm_key=b"k" * 32) as bed:
        sampler = RssSampler(os.getpid())  # the relay, its server and client share this process (p2pd apart)
        with sampler as rss:
            for name, attack, scale in heavy:
                t0 = time.perf_counter()
                answers = bed.attack(attack, *([scale] if scale is not None else []))
                kinds = Counter(a.split(" ")[0] + (" " + a.split(" ")[1] if a.startswith("ERR") else "")
                                for a in answers)
                result = {"attack": name, "tried": len(answers), "answers": dict(kinds),
                          "s": round(time.perf_counter() - t0, 2), "honest_ok": bed.honest_roundtrip(),
                          "rss_mb": round(rss.rss() / MB)}
                print(json.dumps(result), flush=True)
                results.append(result)
    results.append(_record_hijack_row())
    return results


def _record_hijack_row() -> dict:
    """A stranger's record naming a relayed server with the stranger's relay (swarmlm/bench/relay_attacks.py)."""
    from swarmlm.bench.relay_attacks import record_hijack
    from swarmlm.swarm.local import LocalSwarm

    model_dir = str(init_checkpoint("tiny-llama", Path(tempfile.mkdtemp()) / "tiny-llama", seed=2))
    ids = torch.tensor([[1, 5, 9, 13, 17]])
    with LocalSwarm(model_dir) as swarm:
        swarm.start_dht()
        server = swarm.start_server(BlockRange(0, 6), extra=["--reachability", "relayed"])
        seen = record_hijack(swarm, server, ids, 8, clients=4)
    result = {"attack": "a stranger's record naming a relayed server's address and its own relay (4 clients)",
              "tried": len(seen), "own_relay_kept": sum(s["relay_after_reads"] == [s["own_relay"]] * 2 for s in seen),
              "same_tokens": len({tuple(s["tokens"]) for s in seen}) == 1}
    print(json.dumps(result), flush=True)
    return result


def swarm_run(workdir: Path, only: list[str]) -> list[dict]:
    """Attacks that need a swarm (issue 39, holes 7 and 8, hole 1 between servers; swarmlm/bench/swarm_attacks.py),
    on tiny-llama, heavy."""
    from swarmlm.bench import swarm_attacks as sa

    model_dir = str(init_checkpoint("tiny-llama", workdir / "tiny-llama", seed=2))
    results = []
    for attack, kwargs in ((sa.adapter_versions, {"workdir": workdir, "by_name": 12, "pinned": 4}),
                           (sa.lossy_wire_under_load, {"rounds": 10, "loaders": 4}),
                           (sa.push_relay_hijack, {"generations": 8, "new_tokens": 12}),
                           (sa.push_relay_hijack, {"generations": 4, "new_tokens": 12, "strangers": 6,
                                                   "pause_s": 1.5}),
                           (sa.tampering_relay, {"new_tokens": 12, "push": "on"}),
                           (sa.tampering_relay, {"new_tokens": 12, "push": "off"}),
                           (sa.stuck_loader, {})):
        if only and not any(o in attack.__name__ for o in only):
            continue
        with LocalSwarm(model_dir, log_dir=workdir / attack.__name__) as swarm:
            swarm.start_dht()
            t0 = time.perf_counter()
            result = {**attack(swarm, **kwargs), "s": 0.0}
            result["s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(result), flush=True)
        results.append(result)
    return results


def slice_cost(model_dir: str, repeats: int = 3) -> None:
    """In-process: a Forward in one piece vs in slices of one scheduler round (512 tokens / rows), as the server
    computes it; median seconds and the largest difference of the outputs."""
    import statistics

    from transformers import AutoConfig

    from swarmlm.server.stage import Stage

    stage = Stage(model_dir, BlockRange(0, int(AutoConfig.from_pretrained(model_dir).num_hidden_layers)))
    for rows, tokens in ((16, 512), (16, 2048)):
        x = torch.randn(rows, tokens, stage.hidden_size)
        mask = torch.ones(rows, tokens, dtype=torch.long)
        times: dict[str, list[float]] = {"one piece": [], "sliced": []}
        for _ in range(repeats):
            t0 = time.perf_counter()
            whole = stage.forward(stage.blocks, x, mask)
            times["one piece"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            state, size = stage.new_state(stage.blocks, rows, tokens), max(1, 512 // rows)
            sliced = torch.cat([stage.step(state, x[:, i:i + size], mask[:, i:i + size])
                                for i in range(0, tokens, size)], dim=1)
            times["sliced"].append(time.perf_counter() - t0)
        print(json.dumps({"rows": rows, "tokens": tokens, **{k: statistics.median(v) for k, v in times.items()},
                          "max_abs_diff": (whole - sliced).abs().max().item()}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-bloom", help="a preset name (written to a temp dir) or a directory")
    ap.add_argument("--only", nargs="*", default=[], help="substrings of attack names to run")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="write the outcomes as JSON here")
    ap.add_argument("--slice-cost", action="store_true", help="only: a Forward in one piece vs in slices, in-process")
    ap.add_argument("--gateway", action="store_true", help="the attacks on `swarmlm api` instead of a server's")
    ap.add_argument("--relay", action="store_true", help="the attacks on the relay (servers behind NAT)")
    ap.add_argument("--swarm", action="store_true",
                    help="the attacks that need a swarm (adapter versions, lossy wire, push relay)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = args.model
    if not Path(model_dir).is_dir():
        model_dir = str(init_checkpoint(args.model, Path(tempfile.mkdtemp()) / args.model, seed=1))
    if args.slice_cost:
        slice_cost(model_dir)
        return
    if args.swarm:
        results = swarm_run(Path(tempfile.mkdtemp(prefix="swarmlm-swarm-attacks-")), args.only)
        if args.out:
            Path(args.out).write_text(json.dumps({"machine": machine_info(), "swarm": results}, indent=1))
        return
    if args.relay:
        results = relay_run()
        if args.out:
            Path(args.out).write_text(json.dumps({"machine": machine_info(), "relay": results}, indent=1))
        return
    if args.gateway:
        from benchmarks import gateway_attacks

        outcomes = gateway_attacks.run(model_dir, args.only, args.threads)
        print(gateway_attacks.table(outcomes))
        if args.out:
            Path(args.out).write_text(json.dumps([asdict(o) for o in outcomes], indent=1))
        return
    outcomes = run(model_dir, args.only, args.threads)
    print(table(outcomes))
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine_info(), "outcomes": [asdict(o) for o in outcomes]},
                                             indent=1))


if __name__ == "__main__":
    random.seed(0)
    main()
