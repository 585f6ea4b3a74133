"""The push="auto" rule: server-to-server push where the measured RTTs say it saves time (PerfModel.push_saving_s)."""
from __future__ import annotations

import pytest

from swarmlm.client.router import CLIENT, LiveRouter, SwarmView
from swarmlm.config import ClientConfig
from swarmlm.perf.model import PUSH_HOP_S, ComputeProfile, Network, PerfModel
from swarmlm.swarm.records import ServerRecord
from swarmlm.types import Span

PROFILE = ComputeProfile(prefill_a_s=0.001, prefill_b_s=0.002, decode_s=0.003)


def chain(n: int) -> list[Span]:
    return [Span(f"s{i}", 2 * i, 2 * i + 2, f"h{i}:1") for i in range(n)]


def model(client_rtt_s: dict[str, float], server_rtt_s: dict[tuple[str, str], float] = {}) -> PerfModel:
    net = Network()
    for sid, rtt in client_rtt_s.items():
        net.set_link("c", sid, rtt)
    for (a, b), rtt in server_rtt_s.items():
        net.set_link(a, b, rtt)
    return PerfModel({sid: PROFILE for sid in client_rtt_s}, net)


def test_one_server_never_pushes():
    perf = model({"s0": 0.5})
    assert perf.push_saving_s("c", chain(1)) == 0 and not perf.push_pays("c", chain(1))


@pytest.mark.parametrize("n", [2, 3, 4, 6])
def test_equal_links_save_n_minus_one_one_way_delays(n):
    # what push_bench measured at 20 ms: relayed 2N one-way delays, pushed N + 1 (docs/RESULTS-molink.md)
    rtt = 0.05
    perf = model({f"s{i}": rtt for i in range(n)})
    spans = chain(n)
    assert perf.push_saving_s("c", spans) == pytest.approx((n - 1) * (rtt / 2 - PUSH_HOP_S))
    assert perf.push_pays("c", spans)
    assert perf.decode_step_s("c", spans, push=True) == pytest.approx(
        perf.decode_step_s("c", spans) - perf.push_saving_s("c", spans))


def test_loopback_links_do_not_pay_for_the_pushes():
    perf = model({f"s{i}": 0.0005 for i in range(4)})  # RTTs as the client's probes measure them on loopback
    assert not perf.push_pays("c", chain(4))


def test_servers_far_from_each_other_do_not_push():
    # the client sits next to both servers, which are far apart: relaying through the client is the short way
    perf = model({"s0": 0.01, "s1": 0.01}, {("s0", "s1"): 0.1})
    assert not perf.push_pays("c", chain(2))
    # and servers next to each other, far from the client: push saves most of a round trip
    perf = model({"s0": 0.1, "s1": 0.1}, {("s0", "s1"): 0.002})
    assert perf.push_saving_s("c", chain(2)) == pytest.approx(0.1 - 0.001 - PUSH_HOP_S)


def test_an_unmeasured_server_link_is_taken_as_the_slower_client_link():
    perf = model({"s0": 0.02, "s1": 0.06})
    # relayed 0.08; pushed 0.01 + 0.03 + max(0.02, 0.06) / 2 + PUSH_HOP_S
    assert perf.push_saving_s("c", chain(2)) == pytest.approx(0.08 - 0.07 - PUSH_HOP_S)


def test_push_modes_of_the_client_config():
    assert ClientConfig().push == "auto"
    assert ClientConfig(push=True).push == "on" and ClientConfig(push=False).push == "off"
    with pytest.raises(ValueError, match="push must be one of"):
        ClientConfig(push="sometimes")


def test_the_live_router_decides_from_measured_rtts():
    view = SwarmView(ClientConfig())
    view.update({f"s{i}": ServerRecord(f"s{i}", f"h{i}:1", 2 * i, 2 * i + 2, decode_s=0.003) for i in range(3)})
    router = LiveRouter(view, num_blocks=6)
    view.rtt_s.update({f"s{i}": 0.05 for i in range(3)})
    route = router.route(0, 6, 8, 8)
    assert len(route.spans) == 3 and router.push_pays(list(route.spans))
    assert router.perf.push_saving_s(CLIENT, route.spans) == pytest.approx(2 * (0.025 - PUSH_HOP_S))
    view.rtt_s.update({f"s{i}": 0.0005 for i in range(3)})  # the same servers measured on loopback
    router.route(0, 6, 8, 8)
    assert not router.push_pays(list(route.spans))


def test_the_live_router_keeps_its_push_answer_until_it_syncs():
    """A session asks before every step: the performance model answers once per chain of servers, again only after
    the router synced (the links it decides from change there alone)."""
    view = SwarmView(ClientConfig())
    view.update({f"s{i}": ServerRecord(f"s{i}", f"h{i}:1", 2 * i, 2 * i + 2, decode_s=0.003) for i in range(3)})
    router = LiveRouter(view, num_blocks=6)
    view.rtt_s.update({f"s{i}": 0.05 for i in range(3)})
    spans = list(router.route(0, 6, 8, 8).spans)
    asked = []
    model_answer = router.perf.push_pays
    router.perf.push_pays = lambda client, chain: asked.append(len(chain)) or model_answer(client, chain)
    assert all(router.push_pays(spans) for _ in range(3)) and asked == [3]
    assert not router.push_pays(spans[:1]) and asked == [3, 1]
    view.rtt_s.update({f"s{i}": 0.0005 for i in range(3)})
    router.route(0, 6, 8, 8)
    assert not router.push_pays(spans) and asked == [3, 1, 3]
