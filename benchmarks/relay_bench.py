"""A server at home, relayed vs direct, on a real NAT (swarmlm/bench/netem/nat.py) under a link profile (`wan`).

Geometry: the client and the relay (a `swarmlm dht` node) are in the data centre (the root namespace); two servers of
the same blocks are at home, far away (the profile's delay and rate, added by the netem delaying proxy):
  relayed: home 0 behind NAT, connected out to the relay: client -> relay -> [wan] -> home 0
  direct:  home 1 whose router forwards the server's port:   client -> [wan] -> home 1
so both paths cross the same far link once, and the difference is what the relay costs. Each server announces under
its own DHT prefix, so each client routes through one of them. Per run: decode time per token (greedy, push off;
tokens checked against plain transformers), bytes through each home's router per token (everything on its
internet side: gRPC, HTTP/2, libp2p's TLS and muxing, the DHT), and the time from a server's start to its first
token served to a client. Repeated with alternating order; medians. The machine is shared: ratios side by side.

    .venv/bin/python benchmarks/relay_bench.py [--preset tiny-bloom] [--profile wan] [--tokens 32] [--repeats 3]
        [--relay-far]   # the relay far from the client too: its two legs each cross the profile's link
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from swarmlm.bench.netem import DirectionSpec, ListenSpec, RelayProcess, RelayRoute, preset  # noqa: E402
from swarmlm.bench.netem.nat import NatTestbed  # noqa: E402
from swarmlm.client.model import DistributedModelForCausalLM  # noqa: E402
from swarmlm.machine import machine_info  # noqa: E402
from swarmlm.model.random_checkpoint import init_checkpoint  # noqa: E402
from swarmlm.swarm.local import LocalSwarm  # noqa: E402
from swarmlm.types import BlockRange  # noqa: E402

PORT = 43117  # the direct home's forwarded gRPC port
PROMPT_IDS = [[5, 17, 99, 3, 42, 8, 61, 23]]


def _route(profile, far: bool) -> RelayRoute:
    d = DirectionSpec(delay_s=profile.rtt_s / 2, rate_bps=profile.rate_bps) if far else DirectionSpec(delay_s=0.0)
    return RelayRoute(d, d)


def _generate(client, tokens: int):
    ids = torch.tensor(PROMPT_IDS)
    out = client.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens)
    s = client.last_stats
    return out[0, ids.shape[1]:].tolist(), (s.total_s - s.ttft_s) / max(s.new_tokens - 1, 1)


def run(args) -> dict:
    torch.set_num_threads(1)
    profile = preset(args.profile)
    tmp = Path(tempfile.mkdtemp(prefix="relay-bench-"))
    model = str(init_checkpoint(args.preset, tmp / "model", seed=1))
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model).eval()
    with torch.no_grad():
        want = ref.generate(torch.tensor(PROMPT_IDS), max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                            do_sample=False)[0, len(PROMPT_IDS[0]):].tolist()
    n_blocks = ref.config.num_hidden_layers
    with NatTestbed(2, forward={1: PORT}, extra_ips=2) as nat, RelayProcess() as proxy, \
            LocalSwarm(model, log_dir=tmp / "logs") as swarm:
        swarm.start_dht(host=nat.public_ip)
        dht = swarm.initial_peers[0]
        relay_port, relay_id = dht.split("/")[4], dht.split("/")[6]
        # the relay's far side: home 0's connections cross the wan link, the client's (from here) do not
        # (--relay-far: the client's connections cross a wan link to the relay too)
        _, front = proxy.listen(ListenSpec(nat.extra_ip(0), 0, nat.public_ip, int(relay_port),
                                           {nat.router_ip(0): _route(profile, True),
                                            "*": _route(profile, args.relay_far)}))
        proxy.listen(ListenSpec(nat.extra_ip(1), PORT, nat.router_ip(1), PORT, {"*": _route(profile, True)}))
        relay_far_addr = f"/ip4/{nat.extra_ip(0)}/tcp/{front}/p2p/{relay_id}"
        swarm.initial_peers = [relay_far_addr]
        started = time.monotonic()
        relayed = swarm.start_server(BlockRange(0, n_blocks), wait=False, prefix=nat.exec_prefix(0),
                                     host=nat.host_ip(0), extra=["--dht-prefix", "bench-relayed"])
        swarm.initial_peers = [dht]
        direct = swarm.start_server(BlockRange(0, n_blocks), wait=False, prefix=nat.exec_prefix(1), host="0.0.0.0",
                                    extra=["--dht-prefix", "bench-direct", "--port", str(PORT),
                                           "--announce-host", nat.extra_ip(1)])
        clients, usable, ready = {}, {}, {}
        for name, server in (("relayed", relayed), ("direct", direct)):
            swarm.wait_ready([server])
            ready[name] = time.monotonic() - started
        for name in ("relayed", "direct"):  # a new client: DHT read, connect check, RTT probes, first token
            t0 = time.monotonic()
            # (--relay-far: the relayed client knows the relay by its far address only; with a direct connection
            # to the same peer, libp2p would carry the relayed streams on that one)
            peers = [relay_far_addr] if args.relay_far and name == "relayed" else [dht]
            clients[name] = DistributedModelForCausalLM.from_pretrained(
                model, initial_peers=peers, dht_prefix=f"bench-{name}", push="off")
            _generate(clients[name], 1)
            usable[name] = ready[name] + time.monotonic() - t0
        per_token = {"relayed": [], "direct": []}
        bytes_per_token = {"relayed": [], "direct": []}
        exact = {"relayed": True, "direct": True}
        home = {"relayed": 0, "direct": 1}
        for r in range(args.repeats):
            for name in (("relayed", "direct") if r % 2 == 0 else ("direct", "relayed")):
                before = nat.wan_bytes(home[name])
                tokens, s_per_token = _generate(clients[name], args.tokens)
                bytes_per_token[name].append((nat.wan_bytes(home[name]) - before) / args.tokens)
                per_token[name].append(s_per_token)
                exact[name] &= tokens == want
        relay_record = next(iter(clients["relayed"].remote.view.records.values()))
        for c in clients.values():
            c.close()
    med = {k: statistics.median(v) for k, v in per_token.items()}
    med_bytes = {k: statistics.median(v) for k, v in bytes_per_token.items()}
    return {
        "preset": args.preset, "profile": args.profile, "relay_far": args.relay_far, "profile_rtt_ms": profile.rtt_s * 1000,
        "tokens": args.tokens, "repeats": args.repeats, "exact": exact, "relayed_record": relay_record.address,
        "decode_ms_per_token": {k: round(v * 1000, 2) for k, v in med.items()},
        "relayed_over_direct": round(med["relayed"] / med["direct"], 3),
        "uplink_bytes_per_token": {k: round(v) for k, v in med_bytes.items()},
        "extra_bytes_per_token": round(med_bytes["relayed"] - med_bytes["direct"]),
        "start_to_ready_s": {k: round(v, 1) for k, v in ready.items()},
        # ready + a new client's first token through it (each server measured alone)
        "start_to_first_token_s": {k: round(v, 1) for k, v in usable.items()},
        "samples_ms": {k: [round(x * 1000, 2) for x in v] for k, v in per_token.items()},
        "machine": machine_info(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny-bloom")
    p.add_argument("--profile", default="wan")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--relay-far", action="store_true",
                   help="the relay is far from the client too (a wan link on each side of it)")
    p.add_argument("--out", help="also write the result as JSON here")
    args = p.parse_args()
    result = run(args)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
