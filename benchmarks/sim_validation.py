"""Does the simulator predict the real swarm? The same small scenario, run for real and simulated.

Real: small-bloom (8 blocks, d_model 512) on N loopback server processes (even split, 1 thread each), a fixed
workload of sequential requests through the real client. Simulated: the same placement and workload, with
each server's compute profile as the server itself measured and announced it at start-up, and the client<->server
RTT the client measures with its Info probe. The BPRR performance model has no term for the client's own compute
(embeddings, final norm, LM head, sampling): it is profiled separately on the client, once, and added to the
prediction. Usage:

    .venv/bin/python benchmarks/sim_validation.py [--servers 2] [--requests 8] [--input 32] [--output 16]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.model.checkpoint import load_config
from swarmlm.model.init import default_checkpoint
from swarmlm.perf.model import ComputeProfile
from swarmlm.planner.plan import Plan
from swarmlm.planner.topology import parse_topology
from swarmlm.sim.arrivals import SimRequest
from swarmlm.sim.scenario import simulate_scenario
from swarmlm.swarm.local import LocalSwarm, even_split
from swarmlm.types import Span


def client_compute_s(client: DistributedModelForCausalLM, tokens: int, repeats: int = 15) -> float:
    """Embeddings for `tokens` new tokens + head and sampling of the last one: the client's part of a step."""
    ids = torch.randint(5, 100, (1, tokens))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        h = client.embed(ids)
        client.head(h[:, -1:]).argmax(-1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def real_run(client, n_requests: int, l_in: int, l_out: int) -> list[dict]:
    records = []
    for i in range(n_requests):
        ids = torch.randint(5, 1000, (1, l_in), generator=torch.Generator().manual_seed(i))
        t0 = time.perf_counter()
        out = client.generate(ids, max_new_tokens=l_out)
        e2e = time.perf_counter() - t0
        s = client.last_stats
        assert out.shape[1] - l_in == s.new_tokens
        records.append({"ttft_s": s.ttft_s, "decode_per_token_s": (s.total_s - s.ttft_s) / max(s.new_tokens - 1, 1),
                        "e2e_s": e2e, "per_token_s": e2e / s.new_tokens, "new_tokens": s.new_tokens})
    return records


def simulate(swarm: LocalSwarm, client, num_blocks: int, n_requests: int, l_in: int, l_out: int,
             client_prefill_s: float, client_decode_s: float) -> list[dict]:
    client.remote.refresh()
    view = client.remote.view
    servers = []
    for s in swarm.servers:
        r = s.ready
        servers.append({"name": s.server_id, "memory_bytes": 64e9,
                        "tau_prefill_s": [r["prefill_a_s"], r["prefill_b_s"]], "tau_decode_s": r["decode_s_per_block"]})
    doc = {
        "model": {"num_blocks": num_blocks, "block_bytes": 1e6, "cache_bytes_per_session_block": 1e6},
        "servers": servers, "clients": [{"name": "client"}],
        "rtt_s": {"client": {s.server_id: view.rtt_s[s.server_id] for s in swarm.servers}},
        "workload": {"input_tokens": l_in, "output_tokens": l_out, "concurrency": 1},
    }
    topology = parse_topology(doc)
    spans = [Span(s.server_id, *s.ready["blocks"]) for s in swarm.servers]
    plan = Plan("fixed", "shortest", 1, {sp.server_id: sp.blocks for sp in spans}, {"client": spans},
                0.0, 0.0, 0.0, 0.0, 0.0)
    # sequential: each request arrives long after the previous one finished (no contention, as in the real run)
    requests = [SimRequest(i, "client", 1000.0 * i, l_in, l_out) for i in range(n_requests)]
    result = simulate_scenario(topology, "cg-bprr", "shortest", requests=requests, plan=plan)
    out = []
    for rec in result.sim.records:
        # the model's time plus the client's own compute: one prefill step and l_out - 1 decode steps
        ttft = rec.ttft_s + client_prefill_s
        e2e = (rec.finish_s - rec.arrival_s) + client_prefill_s + (l_out - 1) * client_decode_s
        out.append({"ttft_s": ttft, "decode_per_token_s": rec.decode_per_token_s + client_decode_s, "e2e_s": e2e,
                    "per_token_s": e2e / l_out})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="small-bloom")
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--input", type=int, default=32)
    parser.add_argument("--output", type=int, default=16)
    parser.add_argument("--out", default="docs/results/sim_validation.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = str(default_checkpoint(args.preset))
    num_blocks = int(load_config(model_dir).num_hidden_layers)
    with LocalSwarm(model_dir, threads=1) as swarm:
        swarm.start(even_split(num_blocks, args.servers))
        client = DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers,
                                                             routing="shortest")
        real_run(client, 2, args.input, 4)  # warm-up: channels, allocator
        real = real_run(client, args.requests, args.input, args.output)
        cp, cd = client_compute_s(client, args.input), client_compute_s(client, 1)
        sim = simulate(swarm, client, num_blocks, args.requests, args.input, args.output, cp, cd)
        client.close()
    rows = {}
    print(f"{args.preset}, {args.servers} servers, {args.requests} sequential requests of {args.input} in / "
          f"{args.output} out (means)")
    print("| metric | measured | simulated | error |\n|---|---|---|---|")
    for key in ("ttft_s", "decode_per_token_s", "per_token_s", "e2e_s"):
        m = statistics.fmean(r[key] for r in real)
        p = statistics.fmean(r[key] for r in sim)
        rows[key] = {"measured": m, "simulated": p, "error": (p - m) / m}
        print(f"| {key} | {m * 1e3:.2f} ms | {p * 1e3:.2f} ms | {(p - m) / m:+.1%} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "client_prefill_s": cp, "client_decode_s": cd,
                                          "metrics": rows}, indent=2))


if __name__ == "__main__":
    main()
