"""WS-RR (the client's WaitingAwareRouter) vs shortest-latency routing under load, real and simulated.

Two replicas of the whole model (small-bloom, loopback, no DHT: the clients read the servers' Info), 1 torch thread
each and the same announced profile (B reads the profile A measured): A already carries `--background` sessions
generating all along (another client pinned to A), B is idle. (Replicas of 1 vs 2 threads do not differ in speed on
this 2-core machine shared by other work: 2 threads measured 16x slower per block than 1.) Then `--clients`
clients, each its own client object (own router, seeing the others only through the servers' announced load),
arrive `--gap` s apart and each generate `--output` tokens. Per routing mode: mean per-token time (end-to-end / tokens) of those clients, the
share of them each replica served, and the mean per-token time of the clients on each replica. Per client the
JSON also keeps what its router believed each replica ran when it chose (`seen`: the announced Info sessions, or
its own) and the load average. Rounds alternate the modes (medians over rounds).

`--pin` runs A on CPU 0 and B on CPU 1 (taskset), so the replicas do not share compute, as on two machines; without
it both servers (and the clients' process) share the host's 2 cores, which the simulator does not model.

Simulated: the same topology (both replicas with the profiles they announced, including the contention f(b) they
measured, each client with the RTTs it measured, the same arrivals, the background sessions as long requests that can
only reach A) through the simulator's `simulate_scenario` (what `swarmlm simulate` runs) with the fixed
placement, under both routing modes.

    .venv/bin/python benchmarks/routing_bench.py [--clients 8] [--background 4] [--rounds 2] [--output 32]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path

import torch

from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.client.channels import info
from swarmlm.machine import machine_info
from swarmlm.model.checkpoint import load_config
from swarmlm.model.random_checkpoint import default_checkpoint
from swarmlm.planner.plan import Plan
from swarmlm.planner.topology import parse_topology
from swarmlm.sim.arrivals import SimRequest
from swarmlm.sim.scenario import simulate_scenario
from swarmlm.swarm.local import LocalSwarm
from swarmlm.types import BlockRange, Span

MODES = ("shortest", "waiting-aware")


def prompt_ids(client: DistributedModelForCausalLM, tokens: int, seed: int) -> torch.Tensor:
    """A random prompt [1, tokens] of ids the model's vocabulary holds (tiny presets have 512)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(5, min(1000, client.config.vocab_size), (1, tokens), generator=generator)


def background(model_dir: str, address: str, sessions: int, stop: threading.Event) -> list[threading.Thread]:
    """`sessions` generations in a loop on one server until `stop` (a client that can only reach it)."""
    client = DistributedModelForCausalLM.from_pretrained(model_dir, servers=[address])

    def loop(seed: int) -> None:
        ids = prompt_ids(client, 16, seed)
        while not stop.is_set():
            client.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(sessions)]
    for t in threads:
        t.start()
    return threads


def wait_for_load(client: DistributedModelForCausalLM, address: str, sessions: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reply, _ = client.remote.loop.run(info(client.remote.channels, address))
        if reply.active_sessions >= sessions:
            return
        time.sleep(0.2)
    raise RuntimeError(f"the background sessions never showed on {address}")


def remember_view(client: DistributedModelForCausalLM) -> dict:
    """Wrap the client's router so the sessions it believed each server ran, when it last chose, are kept."""
    live, seen = client.remote.router, {}
    choose = live.route

    def route(*args, **kwargs):
        spans = choose(*args, **kwargs)
        seen.clear()
        seen.update({sid: st.sessions() for sid, st in live.router._servers.items()})
        return spans

    live.route = route
    return seen


def one_round(model_dir: str, clients: list[DistributedModelForCausalLM], views: list[dict], gap_s: float,
              l_in: int, l_out: int) -> list[dict]:
    """Every client arrives `gap_s` after the previous one and generates once; per client: time per token, replica,
    and the sessions per server its router saw when it chose."""
    results: list[dict] = [{} for _ in clients]

    def run(i: int, client: DistributedModelForCausalLM) -> None:
        ids = prompt_ids(client, l_in, 100 + i)
        t0 = time.perf_counter()
        out = client.generate(ids, max_new_tokens=l_out, min_new_tokens=l_out, do_sample=False)
        e2e = time.perf_counter() - t0
        assert out.shape[1] == l_in + l_out
        stats = client.last_stats
        route = stats.route
        # the servers' side of each decode step (waiting for the compute thread + the forward that ran it) and the
        # client's own compute per token (embeddings, LM head, sampling): where the per-token time goes
        hops = [h for step in stats.steps if step.n_tokens == 1 for h in step.hops]
        results[i] = {"per_token_s": e2e / l_out, "server": route[0].server_id, "hops": len(route),
                      "arrival_s": i * gap_s, "seen": dict(views[i]),
                      "server_step_s": statistics.median(h.queued_s + h.compute_s for h in hops),
                      "server_queued_s": statistics.median(h.queued_s for h in hops),
                      "server_batch": statistics.fmean(h.batched_steps for h in hops),
                      "client_compute_per_token_s": (stats.embed_s + stats.head_s + stats.sample_s) / l_out}

    threads = []
    for i, client in enumerate(clients):
        t = threading.Thread(target=run, args=(i, client))
        t.start()
        threads.append(t)
        time.sleep(gap_s)
    for t in threads:
        t.join()
    return results


def simulate(servers: dict[str, dict], client_rtts: list[dict[str, float]], num_blocks: int, gap_s: float,
             l_in: int, l_out: int, n_background: int, mode: str, extra_s: float = 0.0,
             message_overhead_s: float | None = None) -> list[dict]:
    """The real run's topology through the simulator: client i has the RTTs real client i measured (its shortest
    route is the real one's), plus `extra_s` on every link (the calibrated run); each hop's message cost is the
    performance model's default unless `message_overhead_s` is given."""
    names = list(servers)
    n_clients = len(client_rtts)
    rtts = [{n: rtt.get(n, 0.001) + extra_s for n in names} for rtt in client_rtts]
    bg_rtt = statistics.median(r[names[0]] for r in rtts)
    doc = {
        "model": {"num_blocks": num_blocks, "block_bytes": 1e6, "cache_bytes_per_session_block": 1e6},
        "servers": [{"name": n, "memory_bytes": 64e9, "tau_prefill_s": [r["prefill_a_s"], r["prefill_b_s"]],
                     "tau_decode_s": r["decode_s_per_block"],
                     "tau_decode_rows_s": [r["decode_4rows_s_per_block"], r["decode_16rows_s_per_block"]]}
                    for n, r in servers.items()],
        "clients": [{"name": f"c{i}"} for i in range(n_clients)] + [{"name": "background"}],
        # the background client reaches only A (B is 1,000 s away): its sessions load A, as in the real run
        "rtt_s": {**{f"c{i}": rtt for i, rtt in enumerate(rtts)},
                  "background": {names[0]: bg_rtt, names[1]: 1000.0}},
        "workload": {"input_tokens": l_in, "output_tokens": l_out, "concurrency": n_clients},
        **({} if message_overhead_s is None else {"message_overhead_s": message_overhead_s}),
    }
    topology = parse_topology(doc)
    plan = Plan("fixed", mode, n_clients, {n: BlockRange(0, num_blocks) for n in names},
                {"c0": [Span(names[0], 0, num_blocks)]}, 0.0, 0.0, 0.0, 0.0, 0.0)
    requests = [SimRequest(1000 + i, "background", 0.0, l_in, 100 * l_out) for i in range(n_background)]
    requests += [SimRequest(i, f"c{i}", 1.0 + i * gap_s, l_in, l_out) for i in range(n_clients)]
    result = simulate_scenario(topology, "cg-bprr", mode, requests=requests, plan=plan)  # type: ignore[arg-type]
    rows = []
    for r in sorted(result.sim.records, key=lambda r: r.arrival_s):
        if r.client_id != "background":
            server = r.route[0].server_id
            # a simulated decode step is the link's RTT + the messages' cost + the server's compute at its load
            rows.append({"per_token_s": r.per_token_s, "server": server,
                         "server_step_s": r.decode_per_token_s - rtts[r.request_id][server]
                         - topology.perf.message_overhead_s})
    return rows


def summary(rows: list[dict], names: dict[str, str]) -> dict:
    share = {label: sum(r["server"] == sid for r in rows) / len(rows) for sid, label in names.items()}
    def by_replica(key: str) -> dict:
        out = {}
        for sid, label in names.items():
            values = [1e3 * r[key] for r in rows if r["server"] == sid and key in r]
            out[label] = statistics.fmean(values) if values else None
        return out

    return {"mean_per_token_ms": 1e3 * statistics.fmean(r["per_token_s"] for r in rows), "share": share,
            "per_token_ms_by_replica": by_replica("per_token_s"), "server_step_ms_by_replica": by_replica("server_step_s"),
            "clients": rows}


def median_of(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def add_results(report: dict, real: dict, ready: dict, client_rtts: dict, num_blocks: int, names: dict, args) -> None:
    """The measured rounds' medians, the simulator's prediction from the servers' profiles and the clients' RTTs,
    and the calibrated prediction (plus what the model leaves out per token), per routing mode."""
    for mode in MODES:
        rounds = [summary(rows, names) for rows in real[mode]]
        report["real"][mode] = {
            "mean_per_token_ms": statistics.median(x["mean_per_token_ms"] for x in rounds),
            "share": {label: statistics.median(x["share"][label] for x in rounds) for label in names.values()},
            "per_token_ms_by_replica": {label: median_of([x["per_token_ms_by_replica"][label] for x in rounds])
                                        for label in names.values()},
            "server_step_ms_by_replica": {label: median_of([x["server_step_ms_by_replica"][label] for x in rounds])
                                          for label in names.values()},
            "rounds": rounds,
        }
        sim = simulate(ready, client_rtts[mode], num_blocks, args.gap, args.input, args.output, args.background, mode)
        report["simulated"][mode] = summary(sim, names)
    # what the model leaves out: per token, everything but the servers' side of a step (the client's compute and
    # Python, gRPC, the host's other work), median over every client of both modes. Added to each link's RTT, the
    # simulator then models only the servers (profiles with f(b)) and the routers: the "calibrated" prediction
    rows = [row for mode in MODES for rnd in real[mode] for row in rnd]
    outside_s = statistics.median(r["per_token_s"] - r["server_step_s"] for r in rows)
    report["outside_servers_ms_per_token"] = 1e3 * outside_s
    report["client_compute_ms_per_token"] = 1e3 * statistics.median(r["client_compute_per_token_s"] for r in rows)
    report["calibrated"] = {}
    for mode in MODES:
        sim = simulate(ready, client_rtts[mode], num_blocks, args.gap, args.input, args.output, args.background, mode,
                       extra_s=outside_s, message_overhead_s=0.0)  # (the messages' cost is in outside_s)
        report["calibrated"][mode] = summary(sim, names)


def print_table(report: dict, names: dict, loads: list, args) -> None:
    print(f"{args.preset}: A = {args.background} background sessions, B idle (1 thread each"
          f"{', pinned to CPU 0 / 1' if args.pin else ', same 2 cores'}); "
          f"{args.clients} clients {args.gap} s apart, {args.input} in / {args.output} out; medians of "
          f"{args.rounds} rounds")
    print("| routing | run | ms/token | share A / B | ms/token on A / B | server part of a step on A / B (ms) |")
    print("|---|---|---|---|---|---|")
    ms = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    la, lb = names.values()
    for mode in MODES:
        for kind in ("real", "simulated", "calibrated"):
            x = report[kind][mode]
            pb_, sb_ = x["per_token_ms_by_replica"], x["server_step_ms_by_replica"]
            print(f"| {mode} | {kind} | {x['mean_per_token_ms']:.1f} | {x['share'][la]:.0%} / {x['share'][lb]:.0%} | "
                  f"{ms(pb_[la])} / {ms(pb_[lb])} | {ms(sb_[la])} / {ms(sb_[lb])} |")
    print(f"outside the servers per token (median): {report['outside_servers_ms_per_token']:.1f} ms, of which the "
          f"client's compute {report['client_compute_ms_per_token']:.1f} ms")
    print("load average (1 min) over the run:", " ".join(f"{x[0]:.1f}" for x in loads))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-bloom")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--background", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gap", type=float, default=0.3, help="seconds between two clients' arrivals")
    ap.add_argument("--input", type=int, default=16)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--out", default="docs/results/routing_bench.json")
    ap.add_argument("--pin", action="store_true",
                    help="run A on CPU 0 and B on CPU 1 (taskset): replicas that do not share compute, as two "
                         "machines would (the simulator's servers never do); the clients' process runs on both")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = str(default_checkpoint(args.preset))
    num_blocks = int(load_config(model_dir).num_hidden_layers)
    with LocalSwarm(model_dir, threads=1, with_dht=False) as swarm:
        pin = (["taskset", "-c", "0"], ["taskset", "-c", "1"]) if args.pin else ((), ())
        a = swarm.start_server(BlockRange(0, num_blocks), prefix=pin[0])
        b = swarm.start_server(BlockRange(0, num_blocks), prefix=pin[1])  # after A: it reads A's cached profile
        names = {a.server_id: f"A ({args.background} sessions running)", b.server_id: "B (idle)"}
        stop = threading.Event()
        bg = background(model_dir, a.address, args.background, stop)
        clients = {mode: [DistributedModelForCausalLM.from_pretrained(model_dir, servers=[a.address, b.address],
                                                                      routing=mode) for _ in range(args.clients)]
                   for mode in MODES}
        views = {mode: [remember_view(c) for c in clients[mode]] for mode in MODES}
        loads: list[tuple[float, float, float]] = [os.getloadavg()]
        try:
            for c in clients["shortest"] + clients["waiting-aware"]:  # warm-up: channels, RTT probes
                c.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2)
            wait_for_load(clients["shortest"][0], a.address, args.background)
            real: dict[str, list[list[dict]]] = {m: [] for m in MODES}
            for r in range(args.rounds):
                for mode in MODES if r % 2 == 0 else MODES[::-1]:
                    rows = one_round(model_dir, clients[mode], views[mode], args.gap, args.input, args.output)
                    loads.append(os.getloadavg())
                    for row in rows:
                        row["seen"] = {names[sid][0]: n for sid, n in row["seen"].items()}
                    real[mode].append(rows)
                    s = summary(rows, names)
                    print(mode, f"{s['mean_per_token_ms']:.1f} ms/token", s["share"], s["per_token_ms_by_replica"],
                          f"load {loads[-1][0]:.1f}", flush=True)
            # each client measured its own RTTs (shortest latency decides by them): kept per client
            client_rtts = {m: [dict(c.remote.view.rtt_s) for c in clients[m]] for m in MODES}
            rtt = {sid: statistics.median(c.remote.view.rtt_s[sid] for m in MODES for c in clients[m]
                                          if sid in c.remote.view.rtt_s) for sid in names}
        finally:
            stop.set()
            for t in bg:
                t.join(60)
            for c in clients["shortest"] + clients["waiting-aware"]:
                c.close()
        ready = {s.server_id: s.ready for s in (a, b)}
    report: dict = {"args": vars(args), "profiles": ready, "rtt_s": rtt, "client_rtt_s": client_rtts,
                    "load_average": loads, "real": {}, "simulated": {}}
    add_results(report, real, ready, client_rtts, num_blocks, names, args)
    print_table(report, names, loads, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine_info(), **report}, indent=2))


if __name__ == "__main__":
    main()
