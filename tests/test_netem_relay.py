"""The delaying relay on its own, and the relay-only testbed (no rights needed)."""
import os
import random
import statistics
import signal
import subprocess
import sys
import textwrap
import time
from concurrent import futures

import grpc
import pytest

from swarmlm.bench.netem import (DirectionSpec, LinkProfile, ListenSpec, RelayProcess, RelayRoute, Testbed, measure_rtt,
                                 preset, start_probe_server)
from swarmlm.bench.netem.accuracy import check_testbed
from swarmlm.bench.netem.link_probe import _connect, _recv_exact
from tests.swarm_helpers import assert_delay_applies, assert_faster_than, assert_link_follows

PROFILES = {"lan": preset("lan"), "wan": preset("wan"), "custom": LinkProfile(rtt_s=0.020, rate_bps=100e6)}


@pytest.fixture
def echo_port():
    proc, port = start_probe_server("127.0.0.1", 0)
    yield port
    proc.kill()
    proc.wait()


def _relayed(relay: RelayProcess, port: int, forward: DirectionSpec, backward: DirectionSpec | None = None) -> str:
    routes = {"*": RelayRoute(forward, backward or forward)}
    host, relay_port = relay.listen(ListenSpec("127.0.0.1", 0, "127.0.0.1", port, routes))
    return f"{host}:{relay_port}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_jitter_varies_delay_but_keeps_bytes_in_order_over_many_connections(echo_port):
    with RelayProcess() as relay:
        address = _relayed(relay, echo_port, DirectionSpec(delay_s=0.002, jitter_s=0.0015))
        rtt = measure_rtt(address, samples=60)
        assert rtt.p90_s - rtt.p10_s > 0.001, rtt  # uniform +-1.5 ms each way really spreads the RTT
        assert_delay_applies(rtt, 0.004)

        def roundtrip(seed: int) -> bool:
            payload = random.Random(seed).randbytes(150_000)
            with _connect(address, 10) as sock:
                sock.sendall(b"E")
                reader = futures.ThreadPoolExecutor(1).submit(_recv_exact, sock, len(payload))
                for i in range(0, len(payload), 3000):  # many small writes: many jittered chunks
                    sock.sendall(payload[i:i + 3000])
                return reader.result(timeout=30) == payload

        with futures.ThreadPoolExecutor(40) as pool:
            assert all(pool.map(roundtrip, range(40)))


def test_loss_becomes_retransmission_delay(echo_port):
    """Lost packets arrive 15 ms late instead of never. Beside the lossy link, the same link without loss is
    measured in alternating rounds: what a busy host adds shows in both, what the loss adds only in one."""
    with RelayProcess() as relay:
        lossy = _relayed(relay, echo_port, DirectionSpec(delay_s=0.001, loss=0.1, retransmit_s=0.015))
        clean = _relayed(relay, echo_port, DirectionSpec(delay_s=0.001))
        rtt_ms: dict[str, list[float]] = {"lossy": [], "clean": []}
        for _ in range(5):
            for name, address in (("lossy", lossy), ("clean", clean)):
                rtt_ms[name] += [x * 1e3 for x in _rtts(address, 30)]
    late = {name: sum(t >= 17 for t in times) for name, times in rtt_ms.items()}  # 15 ms on top of the 2 ms RTT
    # each 64-byte message is one packet: P(either direction lost) = 1 - 0.9^2 = 19%, i.e. ~28 of 150 (a busy host
    # makes messages late on both links: never fewer than the lost ones, not many more than the clean link's)
    assert late["lossy"] >= 12 and late["lossy"] <= late["clean"] + 50, late
    # most messages pay no retransmission: the lossy link's median is the clean one's
    assert statistics.median(rtt_ms["lossy"]) < statistics.median(rtt_ms["clean"]) + 10, rtt_ms


def _rtts(address: str, n: int) -> list[float]:
    with _connect(address, 10) as sock:
        sock.sendall(b"E")
        times = []
        for _ in range(n):
            start = time.monotonic()
            sock.sendall(b"x" * 64)
            _recv_exact(sock, 64)
            times.append(time.monotonic() - start)
    return times


def test_grpc_streams_pass_through_with_the_delay():
    server = grpc.server(futures.ThreadPoolExecutor(4))
    identity = lambda b: b  # noqa: E731 - raw bytes in and out
    handlers = {"Echo": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req, identity, identity),
                "Stream": grpc.stream_stream_rpc_method_handler(lambda it, ctx: (m for m in it), identity, identity)}
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("netem.Test", handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with RelayProcess() as relay, grpc.insecure_channel(_relayed(relay, port, DirectionSpec(delay_s=0.010))) as ch:
            echo = ch.unary_unary("/netem.Test/Echo", identity, identity)
            assert echo(b"warm-up", timeout=60) == b"warm-up"
            start = time.monotonic()
            assert echo(b"x" * 100_000, timeout=60) == b"x" * 100_000
            assert time.monotonic() - start >= 0.020  # at least one RTT of 20 ms (a busy machine only adds)
            stream = ch.stream_stream("/netem.Test/Stream", identity, identity)
            messages = [bytes([i]) * 1000 for i in range(50)]
            assert list(stream(iter(messages), timeout=60)) == messages
    finally:
        server.stop(0)


def test_relay_process_exits_on_close_and_with_its_parent():
    relay = RelayProcess()
    pid = relay.pid
    relay.close()
    assert not _alive(pid)
    # a parent killed with SIGKILL gets no chance to clean up: the relay must notice by itself
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import time
        from swarmlm.bench.netem import RelayProcess
        print(RelayProcess().pid, flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    relay_pid = int(parent.stdout.readline())
    assert _alive(relay_pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 60
    while _alive(relay_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(relay_pid)


def test_listen_errors_are_reported():
    with RelayProcess() as relay:
        spec = ListenSpec("127.0.0.1", 0, "127.0.0.1", 9, {"*": RelayRoute(DirectionSpec(0.0), DirectionSpec(0.0))})
        _, port = relay.listen(spec)
        with pytest.raises(OSError, match="Address already in use"):
            relay.listen(ListenSpec("127.0.0.1", port, "127.0.0.1", 9, spec.routes))


@pytest.mark.parametrize("name", PROFILES)
def test_relay_only_testbed_follows_the_profile(name):
    profile = PROFILES[name]
    with Testbed(2, profile, mode="relay-only") as tb:
        assert tb.mode == "relay-only" and tb.exec_prefix(0) == []
        assert_link_follows(check_testbed(tb, host=1))
        relay_pid = tb._relay.pid
    assert not _alive(relay_pid)


def test_relay_only_server_to_server_links_use_their_own_profile():
    fast, slow = LinkProfile(rtt_s=0.002), LinkProfile(rtt_s=0.030)
    with Testbed(2, _matrix_with_slow_pair(fast, slow), mode="relay-only") as tb:
        proc, port = start_probe_server(tb.host_ip(1), 0)
        try:
            assert tb.expose(1, port) == f"{tb.announce_host(1)}:{port}"
            from_client = measure_rtt(tb.expose(1, port), samples=10)
            from_host0 = measure_rtt(tb.expose(1, port, src=0), samples=10)
        finally:
            proc.kill()
            proc.wait()
    assert_delay_applies(from_client, 0.002)
    assert_faster_than(from_client, 0.030)  # not through the pair's 30 ms link
    assert_delay_applies(from_host0, 0.030)  # the pair's own link, not the client's 2 ms one


def _matrix_with_slow_pair(fast: LinkProfile, slow: LinkProfile):
    from swarmlm.bench.netem import LinkMatrix

    links = [[fast] * 3 for _ in range(3)]
    links[1][2] = links[2][1] = slow  # host 0 <-> host 1 (row/column 0 is the client)
    return LinkMatrix(2, tuple(tuple(row) for row in links))
