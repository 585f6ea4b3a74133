"""The gateway section of the attack suite (issue 28): each attack against a real `swarmlm api` in front of a DHT and 2
servers, while an honest client (another source address, 127.0.0.2) sends a greedy request and /health is polled.

Per attack: the outcome (status codes), the honest request's latency during the attack, the slowest /health answer,
the gateway's RSS (before / peak), whether the servers' sessions went back to 0, and whether the honest greedy text
after the attack equals the text before any attack.

    .venv/bin/python benchmarks/attacks.py --gateway [--only NAME ...]

The light versions of the same cases run in tests/test_api_hostile.py.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from typing import Callable

import httpx2 as httpx

MB = 1 << 20
PROMPT = "The quick brown fox"
HONEST = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}


@dataclass
class GatewayOutcome:
    attack: str
    tried: int
    outcome: str
    honest_latency_s: float  # the honest request sent during the attack
    health_max_s: float  # the slowest /health answer during the attack (polled every 0.2 s)
    rss_before_mb: float
    rss_peak_mb: float
    sessions_back_to_0: bool
    honest_same_after: bool


class Ctx:
    def __init__(self, url: str, model: str, initial_peers: list[str]) -> None:
        self.url, self.model, self.initial_peers = url, model, initial_peers
        self.host, self.port = url.removeprefix("http://").split(":")

    def post(self, body: dict, path: str = "/v1/completions", **kw) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json={"model": self.model, **body}, timeout=kw.pop("timeout", 300),
                          **kw)

    def raw(self, data: bytes) -> socket.socket:
        s = socket.create_connection((self.host, int(self.port)), timeout=60)
        s.sendall(data)
        return s


def _many(n: int, fn: Callable[[int], str], workers: int = 16) -> str:
    from concurrent.futures import ThreadPoolExecutor

    def safe(i: int) -> str:
        try:
            return fn(i)
        except Exception as exc:
            return type(exc).__name__

    with ThreadPoolExecutor(workers) as pool:
        counts = Counter(pool.map(safe, range(n)))
    return ", ".join(f"{n} x {c}" for c, n in sorted(counts.items()))


def seeds(ctx: Ctx) -> tuple[int, str]:
    bad = [2 ** 64, 2 ** 64 - 1, -2 ** 63 - 1, 10 ** 40]
    return 40, _many(40, lambda i: str(ctx.post({"prompt": PROMPT, "max_tokens": 4, "n": 2,
                                                 "seed": bad[i % 4]}).status_code))


def forged_record(ctx: Ctx) -> tuple[int, str]:
    from hivemind.utils import get_dht_time

    from swarmlm.swarm.dht import default_dht_prefix, fetch_records, owner_subkey
    from swarmlm.swarm.dht_thread import ThreadDHT
    from swarmlm.swarm.identity import Identity
    from tests.test_identity import RawDHT

    reader, attacker = ThreadDHT(ctx.initial_peers), Identity.generate()
    raw = RawDHT(ctx.initial_peers, attacker)
    try:
        dht_prefix = default_dht_prefix(ctx.model)
        records = {}
        for _ in range(60):  # a node that just joined may not find the records at once
            records = fetch_records(reader, dht_prefix, range(6))
            if records:
                break
            time.sleep(1)
        honest = next(iter(records.values()))
        forged = replace(honest, server_id=attacker.server_id, address="127.0.0.1:9", max_length=1)
        raw.write(dht_prefix, forged, owner_subkey(attacker.server_id, attacker.validator), get_dht_time() + 30)
        out = []
        for _ in range(5):
            out.append(str(ctx.post({**HONEST, "max_tokens": 2}).status_code))
            time.sleep(2.5)
        return 5, "requests after a forged max_length=1 record: " + ", ".join(out)
    finally:
        raw.shutdown()
        reader.shutdown()


def big_body(ctx: Ctx) -> tuple[int, str]:
    body = b'{"model": "m", "prompt": "' + b"a" * (10 * MB) + b'"}'

    def one(_: int) -> str:
        return str(httpx.post(f"{ctx.url}/v1/completions", content=body, timeout=300,
                              headers={"Content-Type": "application/json"}).status_code)
    return 8, "10 MB bodies: " + _many(8, one, 4)


def long_prompts(ctx: Ctx) -> tuple[int, str]:
    prompt = "hello world, " * (250_000 // 13)  # just under the character cap: tokenized (~1 s each here)
    return 8, "250k-char prompts: " + _many(8, lambda i: str(ctx.post({"prompt": prompt}).status_code), 8)


def fan_out(ctx: Ctx) -> tuple[int, str]:
    return 20, "prompt x64, n=16: " + _many(20, lambda i: str(ctx.post({"prompt": ["a"] * 64, "n": 16}).status_code))


def bogus_keys(ctx: Ctx) -> tuple[int, str]:
    """64 streams at once, each with its own made-up Authorization header."""
    def one(i: int) -> str:
        with httpx.stream("POST", f"{ctx.url}/v1/completions", timeout=300,
                          json={"model": ctx.model, "prompt": PROMPT, "max_tokens": 200, "stream": True},
                          headers={"Authorization": f"Bearer made-up-{i}"}) as r:
            for _ in r.iter_lines():
                pass
            return str(r.status_code)
    return 64, _many(64, one, 64)


def dropped_clients(ctx: Ctx) -> tuple[int, str]:
    """16 non-streaming requests of 2000 tokens whose clients go away after 1 s."""
    body = json.dumps({"model": ctx.model, "prompt": PROMPT, "max_tokens": 2000}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
    socks = [ctx.raw(head + body) for _ in range(16)]
    time.sleep(1.0)
    for s in socks:
        s.close()
    return 16, "16 x 2000-token requests dropped after 1 s"


def slowloris(ctx: Ctx) -> tuple[int, str]:
    socks = [ctx.raw(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-a: ") for _ in range(100)]
    time.sleep(15)  # beyond the header timeout (10 s)
    closed = 0
    for s in socks:
        s.settimeout(0.5)
        try:
            closed += s.recv(16) == b""
        except OSError:
            pass
        s.close()
    return 100, f"{closed} of 100 half-sent connections closed by the gateway after 15 s"


def bad_values(ctx: Ctx) -> tuple[int, str]:
    bodies = [b'{"model": "%s", "prompt": "\\ud800", "max_tokens": 2}' % ctx.model.encode(),
              json.dumps({"model": ctx.model, "prompt": "x", "temperature": 1e-300}).encode(),
              json.dumps({"model": ctx.model, "prompt": "x", "stop": "s" * (MB // 2)}).encode()]

    def one(i: int) -> str:
        return str(httpx.post(f"{ctx.url}/v1/completions", content=bodies[i % 3], timeout=60,
                              headers={"Content-Type": "application/json"}).status_code)
    return 60, "surrogate / temperature 1e-300 / 0.5 MB stop: " + _many(60, one)


def foreign_host(ctx: Ctx) -> tuple[int, str]:
    return 100, _many(100, lambda i: str(httpx.get(f"{ctx.url}/v1/models", headers={"Host": "rebind.example"},
                                                   timeout=60).status_code))


def prefix_timing(ctx: Ctx, guesses: int = 20) -> tuple[int, str]:
    """Issue 39, hole 6: user "a" asks with a PIN in the prompt; user "b" guesses it, watching the servers' prefix hit
    counters (Info) after each guess. Before: the right guess alone raised hit_tokens (a shared scope, public
    counters)."""
    from swarmlm.swarm.dht import default_dht_prefix, fetch_records
    from swarmlm.swarm.dht_thread import ThreadDHT
    from swarmlm.wire import swarm_pb2 as pb
    from swarmlm.wire import swarm_pb2_grpc as pb_grpc
    from swarmlm.wire.channel import sync_channel

    text = "Customer record. Name: A. Example. Address: 1 Main Street. Account PIN: {pin:02d}. " * 2
    reader = ThreadDHT(ctx.initial_peers)
    try:
        addresses = [r.address for r in fetch_records(reader, default_dht_prefix(ctx.model), range(6)).values()]
    finally:
        reader.shutdown()

    def hits() -> int:
        return sum(pb_grpc.SwarmStub(sync_channel(a)).Info(pb.InfoRequest(), timeout=30).prefix_cache.hit_tokens
                   for a in addresses)

    ctx.post({"prompt": text.format(pin=42), "max_tokens": 1, "temperature": 0, "user": "a"})
    rises = []
    for pin in range(guesses):
        before = hits()
        ctx.post({"prompt": text.format(pin=pin if pin != 7 else 42), "max_tokens": 1, "temperature": 0, "user": "b"})
        rises.append(hits() - before)
    right = rises[7]
    return guesses, (f"hit tokens the right guess added: {right}, the others: max {max(rises[:7] + rises[8:])} "
                     f"(counters published: {any(rises)})")


ATTACKS: dict[str, Callable[[Ctx], tuple[int, str]]] = {
    "seeds outside 64 bits (n=2)": seeds,
    "forged DHT record, max_length 1": forged_record,
    "10 MB bodies": big_body,
    "long prompts (tokenizing)": long_prompts,
    "fan-out (64 prompts x n=16)": fan_out,
    "a new Authorization header per stream": bogus_keys,
    "non-streaming clients that go away": dropped_clients,
    "slowloris (100 half-sent headers)": slowloris,
    "surrogate, temperature 1e-300, huge stop": bad_values,
    "foreign Host (DNS rebinding)": foreign_host,
    "guessing another user's prompt by the servers' prefix counters": prefix_timing,
}


# a process of its own: the attack's client threads in this process must not delay the measurement (GIL)
HEALTH_POLL = """
import select, sys, time, urllib.request
worst = 0.0
while not select.select([sys.stdin], [], [], 0.2)[0]:  # until stdin closes
    t0 = time.perf_counter()
    try:
        urllib.request.urlopen(sys.argv[1], timeout=120).read()
    except OSError:
        pass
    worst = max(worst, time.perf_counter() - t0)
print(worst)
"""


class Watch:
    """During an attack: /health polled every 0.2 s from another process (the slowest answer), and one honest
    request (its latency)."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx, self.health_max_s, self.honest_s = ctx, 0.0, float("nan")
        self.threads = [threading.Thread(target=self._honest)]
        self.poller = None

    def _honest(self) -> None:
        time.sleep(0.5)  # the attack is under way
        t0 = time.perf_counter()
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=300) as client:
            client.post(f"{self.ctx.url}/v1/completions", json={"model": self.ctx.model, **HONEST})
        self.honest_s = time.perf_counter() - t0

    def __enter__(self) -> "Watch":
        self.poller = subprocess.Popen([sys.executable, "-c", HEALTH_POLL, f"{self.ctx.url}/health"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        for t in self.threads:
            t.join()
        out, _ = self.poller.communicate(timeout=300)  # closes its stdin: it prints the slowest answer
        self.health_max_s = float(out.strip() or "nan")


def run(model_dir: str, only: list[str], threads: int) -> list[GatewayOutcome]:
    from swarmlm.bench.telemetry import RssSampler
    from swarmlm.api.process import GatewayProcess
    from swarmlm.swarm.local import LocalSwarm, even_split
    from swarmlm.wire import swarm_pb2 as pb
    from tests.swarm_helpers import stub

    outcomes = []
    with LocalSwarm(model_dir, threads=threads) as swarm:
        swarm.start(even_split(6, 2))
        gateway = GatewayProcess(model_dir, swarm.initial_peers, threads=threads,
                                 extra=["--wait-for-blocks", "10"]).start()
        try:
            ctx = Ctx(gateway.url, model_dir, swarm.initial_peers)

            def honest_text() -> str:
                return ctx.post(HONEST).json()["choices"][0]["text"]

            def sessions_back(deadline_s: float = 120) -> bool:
                end = time.monotonic() + deadline_s
                while time.monotonic() < end:
                    if all(stub(s.address).Info(pb.InfoRequest(), timeout=10).active_sessions == 0
                           for s in swarm.servers):
                        return True
                    time.sleep(0.5)
                return False

            want = honest_text()
            for name, attack in ATTACKS.items():
                if only and not any(o in name for o in only):
                    continue
                with RssSampler(gateway.proc.pid) as rss:
                    before = rss.rss()
                    with Watch(ctx) as watch:
                        tried, note = attack(ctx)
                back = sessions_back()
                outcome = GatewayOutcome(name, tried, note, watch.honest_s, watch.health_max_s, before / MB,
                                         rss.peak / MB, back, honest_text() == want)
                print(json.dumps(asdict(outcome)), flush=True)
                outcomes.append(outcome)
        finally:
            gateway.stop()
    return outcomes


def table(outcomes: list[GatewayOutcome]) -> str:
    lines = ["| attack | tried | outcome | honest request during it | slowest /health | gateway RSS before / peak "
             "(MB) | sessions back to 0 | honest text unchanged after |", "|---|---|---|---|---|---|---|---|"]
    for o in outcomes:
        lines.append(f"| {o.attack} | {o.tried} | {o.outcome} | {o.honest_latency_s:.2f} s | {o.health_max_s:.2f} s"
                     f" | {o.rss_before_mb:.0f} / {o.rss_peak_mb:.0f} | {'yes' if o.sessions_back_to_0 else 'NO'} | "
                     f"{'yes' if o.honest_same_after else 'NO'} |")
    return "\n".join(lines)
