"""Helpers for tests that talk to real server processes."""
from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
from typing import Iterator, Sequence

from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire import swarm_pb2_grpc as pb_grpc
from swarmlm.wire.channel import sync_channel


class RawStream:
    """A bidirectional Inference stream driven step by step from a test (sync gRPC)."""

    def __init__(self, address: str, max_message_bytes: int = 256 << 20) -> None:
        self.channel = sync_channel(address, max_message_bytes)
        self.stub = pb_grpc.SwarmStub(self.channel)
        self.requests: queue.Queue = queue.Queue()
        self.replies = self.stub.Inference(iter(self.requests.get, None), timeout=60)

    def send(self, request: pb.InferenceRequest) -> pb.InferenceReply:
        self.requests.put(request)
        return next(self.replies)

    def close(self) -> None:
        self.requests.put(None)
        self.channel.close()


def stub(address: str) -> pb_grpc.SwarmStub:
    return pb_grpc.SwarmStub(sync_channel(address))


def greedy_reference(model_dir: str, text: str, new_tokens: int):
    """What a distributed run must reproduce: the prompt's ids [1, T] and plain transformers' greedy continuation
    (`new_tokens` token ids; min_new_tokens too, so eos never ends it early: a manual step loop never stops there)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(text, return_tensors="pt").input_ids
    ref = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = ref.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return ids, out[0, ids.shape[1]:].tolist()


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
def gateway_stack(model_dir: str, log_dir, extra: Sequence[str] = ()) -> Iterator[tuple]:
    """A DHT, 2 servers and the `swarmlm api` gateway, the gateway starting while the servers load (both take
    seconds); everything stopped on exit. Yields (LocalSwarm, GatewayProcess)."""
    from swarmlm.api.process import GatewayProcess
    from swarmlm.swarm.local import LocalSwarm, even_split

    swarm = LocalSwarm(model_dir)
    gateway = None
    try:
        swarm.start_dht()
        servers = [swarm.start_server(r, wait=False) for r in even_split(6, 2)]
        gateway = GatewayProcess(model_dir, swarm.initial_peers, log_path=log_dir / "api.err", extra=extra)
        gateway.start()
        swarm.wait_ready(servers)
        yield swarm, gateway
    finally:
        if gateway is not None:
            gateway.stop()
        swarm.stop()


def even_out_view(client) -> None:
    """Even out what decides a route at random on a busy machine, so that load alone decides: the same RTT to every
    server (loopback RTTs measured under load differ by several ms, and RTT x tokens would decide) and the same,
    known contention (a tiny model's measured f(b) is ~1 within noise: its forward is mostly fixed overhead)."""
    view = client.remote.view
    for sid, r in view.records.items():
        view.rtt_s[sid] = 0.001
        view.records[sid] = dataclasses.replace(r, decode_4rows_s=2 * r.decode_s, decode_16rows_s=4 * r.decode_s)


def run_in_threads(fn, n: int, timeout_s: float = 300.0) -> None:
    """fn(0) .. fn(n - 1) on n threads at once; fails if one is still running after the (generous) deadline."""
    threads = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
