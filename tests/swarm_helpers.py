"""Helpers for tests that talk to servers.

- a swarm: `running_swarm` (server processes + a client: tests about processes, a DHT, a crash; `server_processes`
  alone where the client is something else, `client_of` for more clients) or `in_process_server` /
  `in_process_swarm` (the same Server code on a thread of this process: tests about the protocol, ready in about a
  second); `gateway_stack`: a swarm and `swarmlm api` gateways;
- the reference it must reproduce: `reference_model`, `reference_generate`, `greedy_reference`, and `greedy_steps` /
  `assert_steps_match_reference` for sessions stepped by hand, and `assert_greedy_up_to_ties` for batched
  output;
- an Inference stream by hand: `RawStream` (swarmlm/bench/raw_stream.py, shared with the attack suite)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import statistics
import functools
import threading
import time
from typing import Iterator, Sequence

from swarmlm import event_loop
from swarmlm.bench.raw_stream import RawStream, greedy_steps  # noqa: F401  (the tests' stream driver and greedy loop)
from swarmlm.wire import swarm_pb2_grpc as pb_grpc
from swarmlm.wire.channel import sync_channel


def poll_until(condition, deadline_s: float = 60.0) -> bool:
    """True once `condition()` is, checked every 0.1 s; False if it never is within `deadline_s`."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.1)
    return False


def stub(address: str) -> pb_grpc.SwarmStub:
    return pb_grpc.SwarmStub(sync_channel(address))


@contextlib.contextmanager
def in_process_server(model_dir: str, blocks, **settings) -> Iterator:
    """One server's whole gRPC service (server.Server, the same code as `swarmlm server`) in this process, on a
    thread of its own: no DHT, no child process, ready in about a second. For tests about the protocol; tests about
    processes (a crash, a kill, a DHT) use running_swarm. `settings`: ServerConfig fields. Yields the Server
    (`.address`, `.service`); stopped on exit."""
    from swarmlm.config import ServerConfig
    from swarmlm.server.server import Server

    server = Server(ServerConfig(model_dir=model_dir, blocks=blocks, **{"drain_timeout_s": 0.0, **settings}))
    loop = event_loop.new_loop()  # (a server's own loop: swarmlm server runs on it too)
    thread = threading.Thread(target=loop.run_forever, name="in-process-server", daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(timeout=180)
        yield server
    finally:
        try:
            if server.service is not None:
                asyncio.run_coroutine_threadsafe(server.stop(), loop).result(timeout=60)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            loop.close()


@dataclasses.dataclass
class InProcessSwarm:
    """Servers of `in_process_swarm`, reached by address (no DHT): what LocalSwarm offers a client test."""

    model_dir: str
    servers: list  # server.Server (`.address`, `.server_id`, `.service`)
    initial_peers = ()  # no DHT

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers]


@contextlib.contextmanager
def in_process_swarm(model_dir: str, ranges, **settings) -> Iterator[InProcessSwarm]:
    """`in_process_server` per range, started one after the other (the later ones read the first's cached profile,
    so equal ranges announce equal speeds); all stopped on exit."""
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(in_process_server(model_dir, r, **settings)) for r in ranges]
        yield InProcessSwarm(model_dir, servers)


# ---- a swarm and the reference it must reproduce ----------------------------------------------------------------

@functools.lru_cache(maxsize=4)
def reference_model(model_dir: str):
    """Plain transformers' model of `model_dir` (fp32, eval): what every distributed output is checked against.
    Loaded once per test run and shared: tests only read it (a setting changed for a test is put back). A GGUF is
    loaded (dequantized) as transformers loads it."""
    from swarmlm.model.checkpoint import load_transformers_model

    return load_transformers_model(model_dir)


def reference_generate(model_dir: str, ids, **kwargs):
    """transformers' own generate() on the reference model: greedy unless `kwargs` say otherwise."""
    import torch

    with torch.no_grad():
        return reference_model(model_dir).generate(ids, **{"do_sample": False, **kwargs})


def greedy_session(client, ids, steps: int, before_step=None):
    """`steps` greedy tokens after `ids` [1, T] in one inference session of `client`, one step a token
    (`before_step(i)`, if given, before decode step i): the tokens and the (closed) session, whose step records and
    spans' histories stay readable."""
    import torch

    with torch.no_grad(), client.inference_session(max_length=ids.shape[1] + steps + 2) as session:
        logits = client.step_logits(session, ids)
        tokens = [int(logits[0, -1].argmax())]
        for i in range(steps - 1):
            if before_step is not None:
                before_step(i)
            logits = client.step_logits(session, torch.tensor([[tokens[-1]]]))
            tokens.append(int(logits[0, -1].argmax()))
        return tokens, session


def greedy_reference(model_dir: str, text: str, new_tokens: int):
    """What a distributed run must reproduce: the prompt's ids [1, T] and plain transformers' greedy continuation
    (`new_tokens` token ids; min_new_tokens too, so eos never ends it early: a manual step loop never stops there)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(text, return_tensors="pt").input_ids
    out = reference_generate(model_dir, ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    return ids, out[0, ids.shape[1]:].tolist()


def assert_greedy_up_to_ties(model_dir: str, prompt: Sequence[int], got: Sequence[int],
                             want: Sequence[int] | None = None, tolerance: float = 1e-3) -> None:
    """`got`, a greedy continuation of `prompt` computed in a batch (numerically not bit-identical to one row: other
    shapes, padding), is plain transformers' greedy one up to ties: the whole sequence through the reference model
    in one forward, every token of `got` has a logit within `tolerance` (absolute, or relative to its size) of its
    position's best; and `got` equals `want` (default: the reference's greedy continuation) up to the first
    position where `want`'s top two logits are that close (from there on a tie may go either way)."""
    import torch

    ref = reference_model(model_dir)
    got, prompt = list(got), list(prompt)
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + got])).logits[0, len(prompt) - 1:-1].float()  # [len(got), V]
    best = logits.max(dim=-1).values
    chosen = logits.gather(1, torch.tensor(got)[:, None])[:, 0]
    bound = tolerance * best.abs().clamp_min(1.0)
    assert bool((best - chosen <= bound).all()), f"not the argmax: {(best - chosen).tolist()} at {got}"
    if want is None:
        want = reference_generate(model_dir, torch.tensor([prompt]), max_new_tokens=len(got),
                                  min_new_tokens=len(got))[0, len(prompt):].tolist()
    want = list(want)[:len(got)]
    with torch.no_grad():
        top2 = ref(torch.tensor([prompt + want])).logits[0, len(prompt) - 1:-1].float().topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > tolerance * top2[:, 0].abs().clamp_min(1.0)
    first_tie = int((~clear).nonzero()[0]) if bool((~clear).any()) else len(want)
    assert got[:first_tie] == want[:first_tie], (got, want, first_tie)


def assert_steps_match_reference(client, model_dir: str, ids, steps: int, tolerance: float = 1e-4) -> None:
    """A session of `client`: the prompt and `steps` greedy decode steps give plain transformers' logits."""
    import torch

    ref = reference_model(model_dir)
    with torch.no_grad(), client.inference_session(max_length=ids.shape[1] + steps, batch_size=ids.shape[0]) as session:
        for seen, got in greedy_steps(client, session, ids, steps):
            want = ref(seen).logits[:, -got.shape[1]:]
            assert (got - want).abs().max().item() < tolerance, seen.shape


@contextlib.contextmanager
def server_processes(model_dir: str, ranges, *, dht: bool = True, server_args: Sequence[str] = (),
                     swarm_key_file=None) -> Iterator:
    """One server process per range (loading at once), with a DHT or reached by address (a private swarm's with
    `swarm_key_file`); all stopped on exit. Yields the LocalSwarm."""
    from swarmlm.swarm.local import LocalSwarm

    with LocalSwarm(model_dir, with_dht=dht, server_args=server_args, swarm_key_file=swarm_key_file) as swarm:
        swarm.start(ranges)
        yield swarm


def client_of(swarm, **settings):
    """A client (DistributedModelForCausalLM, ClientConfig `settings`) of a LocalSwarm or an InProcessSwarm: through
    its DHT if it has one, else given its live servers' addresses. The caller closes it."""
    from swarmlm.client.model import DistributedModelForCausalLM

    where = {"initial_peers": swarm.initial_peers} if swarm.initial_peers else {"servers": swarm.addresses}
    return DistributedModelForCausalLM.from_pretrained(swarm.model_dir, **where, **settings)


@contextlib.contextmanager
def running_swarm(model_dir: str, ranges, *, dht: bool = True, server_args: Sequence[str] = (), swarm_key_file=None,
                  **client_settings) -> Iterator[tuple]:
    """`server_processes` and a client of them (ClientConfig `client_settings`); both stopped on exit. Yields
    (LocalSwarm, DistributedModelForCausalLM)."""
    with server_processes(model_dir, ranges, dht=dht, server_args=server_args,
                          swarm_key_file=swarm_key_file) as swarm, \
            contextlib.closing(client_of(swarm, **client_settings)) as client:
        yield swarm, client


# ---- emulated links on a busy machine --------------------------------------------------------------------------
# A busy machine only ever adds time: a delay the emulator applies is never missing from a measurement, and a rate
# limit is never exceeded, while what the host adds on top varies with load (medians of +40 ms were seen on a 20 ms
# link with the load average at 15 on 2 cores). So tests check only what load cannot break: at least the profile's
# delay, at most its rate, and, to tell links apart, that the fastest round trips stay below another link's delay.
# How closely the emulation follows a profile (within 10 % on a quiet machine) is measured by
# `python -m swarmlm.bench.netem.accuracy` (docs/NETWORK_EMULATION.md).


def assert_delay_applies(rtt, profile_rtt_s: float) -> None:
    """An RttStats whose median carries the profile's delay (the relay subtracts the path's own overhead, ~0.4 ms,
    so the bound is a little below it)."""
    assert rtt.median_s >= 0.8 * profile_rtt_s, (rtt, profile_rtt_s)


def assert_faster_than(rtt, other_rtt_s: float) -> None:
    """An RttStats whose fastest tenth is below `other_rtt_s`: the path does not carry that (longer) delay."""
    assert rtt.p10_s < 0.8 * other_rtt_s, (rtt, other_rtt_s)


def assert_link_follows(check) -> None:
    """A `LinkCheck`: the profile's delay applies, and goodput is limited by its rate (never above it; the lower
    bound only catches a gross error such as bits for bytes)."""
    assert_delay_applies(check.rtt, check.profile.rtt_s)
    expected = check.profile.goodput_bps
    if expected is not None and check.up is not None:
        for measured in (check.up, check.down):
            assert 0.25 * expected < measured.bits_per_s < 1.1 * expected, (check.up, check.down, check.profile)


@contextlib.contextmanager
def gateway_stack(model_dir: str, log_dir, extra: Sequence[str] = (), *, more: Sequence[Sequence[str]] = (),
                  server_extra=lambda i: ()) -> Iterator[tuple]:
    """A DHT, 2 servers (server i with the flags `server_extra(i)`) and the `swarmlm api` gateway (its flags:
    `extra`; `more`: the flags of further gateways over the same swarm), the gateways starting while the servers
    load (both take seconds); logs in `log_dir`; everything stopped on exit. Yields (LocalSwarm, GatewayProcess,
    *the further gateways)."""
    from swarmlm.api.process import GatewayProcess
    from swarmlm.swarm.local import LocalSwarm, even_split

    swarm = LocalSwarm(model_dir, log_dir=log_dir)
    gateways: list[GatewayProcess] = []
    try:
        swarm.start_dht()
        servers = [swarm.start_server(r, wait=False, extra=server_extra(i)) for i, r in enumerate(even_split(6, 2))]
        for i, flags in enumerate([extra, *more]):
            gateways.append(GatewayProcess(model_dir, swarm.initial_peers, log_path=swarm.log_dir / f"api{i}.err",
                                           extra=flags).start())
        swarm.wait_ready(servers)
        yield swarm, *gateways
    finally:
        for gateway in gateways:
            gateway.stop()
        swarm.stop()



def active_sessions(swarm) -> list[int]:
    """Sessions open on each live server of a LocalSwarm, from their Info."""
    from swarmlm.wire import swarm_pb2 as pb

    return [stub(s.address).Info(pb.InfoRequest(), timeout=10).active_sessions for s in swarm.servers if s.alive]


def assert_n_choices_share_a_session(gateway_url: str, swarm, body: dict, headers: dict | None = None) -> None:
    """A streamed request of n choices (`body`) holds one session per server while it streams, not n; and once the
    client goes away every session closes."""
    import time

    import httpx2 as httpx

    assert active_sessions(swarm) == [0] * len(swarm.servers)
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{gateway_url}/v1/completions", json={**body, "stream": True},
                         headers=headers or {}) as response:
            lines = response.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            assert active_sessions(swarm) == [1] * len(swarm.servers)  # one for the n choices
    deadline = time.monotonic() + 60
    while any(active_sessions(swarm)):  # closed when the client went away
        assert time.monotonic() < deadline, f"sessions left open on the servers: {active_sessions(swarm)}"
        time.sleep(0.2)

def even_out_view(client, prefill_a_s: float | None = None) -> None:
    """Even out what decides a route at random on a busy machine, so that load alone decides: the same speed (each
    server measured its own at start, under whatever else ran then) and the same RTT to every
    server (loopback RTTs measured under load differ by several ms, and RTT x tokens would decide) and the same,
    known contention (a tiny model's measured f(b) is ~1 within noise: its forward is mostly fixed overhead).
    `prefill_a_s`: every server's per-token prefill instead of the measured one (a tiny model's is noise: measured
    as 0 under load, its 128-token prefill no slower than its 16-token one, and then a held prefix saves nothing)."""
    view = client.remote.view
    speed = {f: statistics.median(getattr(r, f) for r in view.records.values())
             for f in ("decode_s", "prefill_a_s", "prefill_b_s")}  # one machine: one speed, not each start's noise
    if prefill_a_s is not None:
        speed["prefill_a_s"] = prefill_a_s
    for sid, r in view.records.items():
        view.rtt_s[sid] = 0.001
        view.records[sid] = dataclasses.replace(r, **speed, decode_4rows_s=2 * speed["decode_s"],
                                                decode_16rows_s=4 * speed["decode_s"])


def run_in_threads(fn, n: int, timeout_s: float = 300.0) -> None:
    """fn(0) .. fn(n - 1) on n threads at once; fails if one is still running after the (generous) deadline."""
    threads = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
