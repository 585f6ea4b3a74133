"""Does the simulator predict the real swarm? The same small scenario, run for real and simulated.

Real: small-bloom (8 blocks, d_model 512) on N loopback server processes (even split, 1 thread each), a fixed
workload of sequential requests through the real client. Simulated: the same placement and workload through the
simulator, with each server's compute profile as the server measured and announced it at start-up, and two
calibrated costs from a run before the measured one: per hop, what a decode step costs besides compute (wire, gRPC,
(de)serialisation, scheduling: the BPRR model's per-token round trip t_cj), and the client's own time per step
(embeddings, head, sampling, hand-offs), for which the BPRR model has no term. What is predicted is the composition:
the fitted compute model through the route plus those costs.

Routing is the same code on both sides: the client routes with `planner.routing.WaitingAwareRouter` (client/router.py)
as the simulator does (sim/routers.py); here both with `routing="shortest"` over one even split, so both take the one
chain there is. Requests run one at a time, so the servers' compute contention (f(b), perf/model.py) stays at
f(1) = 1 on both sides. Routing under load, where WS-RR and shortest differ and contention matters, is
benchmarks/routing_bench.py (it reports real vs simulated shares and times per replica). Usage:

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
from swarmlm.machine import machine_info
from swarmlm.model.checkpoint import load_config
from swarmlm.model.random_checkpoint import default_checkpoint
from swarmlm.server.server import profile_model
from swarmlm.planner.plan import Plan
from swarmlm.planner.topology import parse_topology
from swarmlm.sim.arrivals import SimRequest
from swarmlm.sim.scenario import simulate_scenario
from swarmlm.swarm.local import LocalSwarm, even_split
from swarmlm.types import Span


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


def calibrate(client, n: int, l_in: int) -> tuple[dict[str, float], float, float]:
    """From a calibration run (not the measured one): per server, t_cj as the BPRR model means it — what a decode
    step costs per hop besides the blocks' compute (wire, gRPC, (de)serialisation, scheduling); and the client's
    own time per prefill and per decode step outside the hops (embeddings, head, sampling, handing steps to the
    I/O thread), which the BPRR model has no term for."""
    per_server: dict[str, list[float]] = {}
    prefill_client, decode_client = [], []
    for i in range(n):
        ids = torch.randint(5, 1000, (1, l_in), generator=torch.Generator().manual_seed(1000 + i))
        client.generate(ids, max_new_tokens=8)
        st = client.last_stats
        in_hops = [sum(h.wall_s + h.client_io_s for h in step.hops) for step in st.steps]
        prefill_client.append(st.ttft_s - in_hops[0])
        decode_client.append((st.total_s - st.ttft_s) / (st.new_tokens - 1) - statistics.fmean(in_hops[1:]))
        for step in st.steps[1:]:  # decode steps only
            for h in step.hops:
                per_server.setdefault(h.server_id, []).append(h.wall_s - h.compute_s - h.queued_s + h.client_io_s)
    rtt = {sid: statistics.median(v) for sid, v in per_server.items()}
    return rtt, statistics.median(prefill_client), statistics.median(decode_client)


def simulate(swarm: LocalSwarm, client, num_blocks: int, n_requests: int, l_in: int, l_out: int,
             client_prefill_s: float, client_decode_s: float, rtt_s: dict[str, float]) -> list[dict]:
    servers = []
    for s in swarm.servers:
        r = s.ready
        # the whole announced profile, contention included (one request at a time here: f(1) = 1 applies)
        servers.append({"name": s.server_id, "memory_bytes": 64e9,
                        "tau_prefill_s": [r["prefill_a_s"], r["prefill_b_s"]], "tau_decode_s": r["decode_s_per_block"],
                        "tau_decode_rows_s": [r["decode_4rows_s_per_block"], r["decode_16rows_s_per_block"]]})
    doc = {
        "model": {"num_blocks": num_blocks, "block_bytes": 1e6, "cache_bytes_per_session_block": 1e6},
        "servers": servers, "clients": [{"name": "client"}],
        "rtt_s": {"client": {s.server_id: rtt_s[s.server_id] for s in swarm.servers}},
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
    ranges = even_split(num_blocks, args.servers)
    for r in ranges:  # profile each span alone first: N servers profiling at once on 2 cores would slow each other
        profile_model(model_dir, r, "float32", 1, refresh=True)
    with LocalSwarm(model_dir, threads=1) as swarm:
        swarm.start(ranges)
        client = DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers,
                                                             routing="shortest")
        real_run(client, 2, args.input, 4)  # warm-up: channels, allocator
        # calibration, before the measured run: the client's own compute and the per-hop cost of a step
        rtt, cp, cd = calibrate(client, 5, args.input)
        real = real_run(client, args.requests, args.input, args.output)
        sim = simulate(swarm, client, num_blocks, args.requests, args.input, args.output, cp, cd, rtt)
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
    Path(args.out).write_text(json.dumps({"args": vars(args), "machine": machine_info(), "client_prefill_s": cp, "client_decode_s": cd,
                                          "hop_overhead_s": rtt,
                                          "metrics": rows}, indent=2))


if __name__ == "__main__":
    main()
