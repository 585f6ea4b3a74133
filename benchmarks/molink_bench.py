"""MoLink techniques on the client: chunked prefill and decode-first transmission, on/off side by side.

One swarm per network profile (netem testbed hosts; or plain loopback), one client per variant (each with its own
channels and link schedulers), the same Poisson mix of long and short prompts for every variant. Variants run in
interleaved rounds (a different order each round) so the machine's background load hits them alike.

    .venv/bin/python benchmarks/molink_bench.py --networks 100mbit-20ms,1gbit-1ms --rounds 3 --requests 8

Reports per variant: TTFT p50/p90, time per output token (TPOT, per request: decode time / (tokens - 1)) p50/p90,
throughput (generated tokens / makespan), all medians over rounds where noted.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.config import ClientConfig
from swarmlm.machine import machine_info
from swarmlm.model.random_checkpoint import init_checkpoint
from swarmlm.swarm.local import LocalSwarm, even_split

NETWORKS = {  # name -> (rtt_s, rate_bps); "loopback" = no emulation
    "100mbit-20ms": (0.020, 100e6),
    "1gbit-1ms": (0.001, 1e9),
    "20mbit-20ms": (0.020, 20e6),
    "loopback": None,
}
VARIANTS = {  # name -> ClientConfig overrides
    "baseline": dict(prefill_chunk_tokens=0, decode_first=False, push=False),
    "chunking": dict(prefill_chunk_tokens=None, decode_first=False, push=False),
    "decode-first": dict(prefill_chunk_tokens=0, decode_first=True, push=False),
    "both": dict(prefill_chunk_tokens=None, decode_first=True, push=False),
    "push": dict(prefill_chunk_tokens=0, decode_first=False, push=True),  # server-to-server push alone
    "all": dict(prefill_chunk_tokens=None, decode_first=True, push=True),
}


@dataclass(frozen=True)
class Request:
    arrival_s: float
    prompt: tuple[int, ...]
    new_tokens: int


def workload(n: int, rate_per_s: float, long_tokens: int, short_tokens: int, long_share: float, new_tokens: int,
             vocab: int, seed: int) -> list[Request]:
    """Poisson arrivals; a long_share of the prompts are long (several hundred tokens), the rest short."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate_per_s)
        length = long_tokens if rng.random() < long_share else short_tokens
        out.append(Request(t, tuple(rng.randrange(3, vocab) for _ in range(length)), new_tokens))
    return out


def run_requests(client: DistributedModelForCausalLM, requests: list[Request]) -> dict:
    """Every request in its own thread at its arrival time; per request TTFT and TPOT from the generate stats."""
    results: list[dict] = [{} for _ in requests]
    t0 = time.perf_counter()

    def one_with_clock(i: int, r: Request) -> None:
        time.sleep(max(0.0, r.arrival_s - (time.perf_counter() - t0)))
        start = time.perf_counter()
        ids = torch.tensor([r.prompt])
        with client.inference_session(max_length=len(r.prompt) + r.new_tokens, l_in_hint=len(r.prompt),
                                      l_out_hint=r.new_tokens) as session:
            logits = client.step_logits(session, ids)
            first = time.perf_counter()
            for _ in range(r.new_tokens - 1):
                nxt = logits[:, -1:].argmax(-1)
                logits = client.step_logits(session, nxt)
            end = time.perf_counter()
            chunks = session.steps[0].chunks
        results[i] = {"prompt": len(r.prompt), "ttft_s": first - start, "tpot_s": (end - first) / (r.new_tokens - 1),
                      "end_s": end - t0, "chunks": chunks}

    threads = [threading.Thread(target=one_with_clock, args=(i, r)) for i, r in enumerate(requests)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    makespan = max(r["end_s"] for r in results)
    return {"requests": results, "makespan_s": makespan,
            "throughput_tok_s": sum(r.new_tokens for r in requests) / makespan}


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


def summarise(rounds: list[dict]) -> dict:
    reqs = [r for rnd in rounds for r in rnd["requests"]]
    short = [r for r in reqs if r["prompt"] < 100]
    return {
        "ttft_p50_s": pct([r["ttft_s"] for r in reqs], 0.5), "ttft_p90_s": pct([r["ttft_s"] for r in reqs], 0.9),
        "tpot_p50_s": pct([r["tpot_s"] for r in reqs], 0.5), "tpot_p90_s": pct([r["tpot_s"] for r in reqs], 0.9),
        "short_ttft_p50_s": pct([r["ttft_s"] for r in short], 0.5) if short else None,
        "throughput_tok_s": statistics.median(rnd["throughput_tok_s"] for rnd in rounds),
        "chunks_long_prompt": max(r["chunks"] for r in reqs),
        "requests": len(reqs),
    }


def start_servers(model_dir: str, network: str, n: int, num_blocks: int, stack):
    """Servers on emulated hosts (addresses through the relay), or on loopback; returns their addresses."""
    ranges = even_split(num_blocks, n)
    profile = NETWORKS[network]
    if profile is None:
        local = stack.enter_context(LocalSwarm(model_dir, with_dht=False))
        started = [local.start_server(r, wait=False) for r in ranges]
        local.wait_ready(started)
        return [s.address for s in started], {"mode": "loopback"}
    from swarmlm.bench.netem import LinkProfile, Testbed

    tb = stack.enter_context(Testbed(n, LinkProfile(rtt_s=profile[0], rate_bps=profile[1])))
    local = stack.enter_context(LocalSwarm(model_dir, with_dht=False))
    port = 40500
    started = [local.start_server(r, extra=["--port", str(port + i)], wait=False, prefix=tb.exec_prefix(i),
                                  host=tb.host_ip(i)) for i, r in enumerate(ranges)]
    local.wait_ready(started)
    return [tb.expose(i, port + i) for i in range(n)], {"mode": tb.mode, "rtt_s": profile[0], "rate_bps": profile[1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small-bloom")
    ap.add_argument("--layers", type=int, default=4, help="blocks in the model (same widths as the preset)")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--networks", default="100mbit-20ms,1gbit-1ms")
    ap.add_argument("--variants", default="baseline,chunking,decode-first,both")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8, help="per round and variant")
    ap.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second")
    ap.add_argument("--long-tokens", type=int, default=384)
    ap.add_argument("--short-tokens", type=int, default=16)
    ap.add_argument("--long-share", type=float, default=0.3)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--out", default="out/molink")
    args = ap.parse_args()
    import contextlib

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = str(init_checkpoint(args.preset, Path("out/checkpoints") / f"{args.preset}-{args.layers}l", seed=0,
                                    num_layers=args.layers))
    variants = args.variants.split(",")
    report = {"args": vars(args), "networks": {}}
    for network in args.networks.split(","):
        with contextlib.ExitStack() as stack:
            addresses, info = start_servers(model_dir, network, args.servers, args.layers, stack)
            clients = {v: DistributedModelForCausalLM(model_dir, ClientConfig(servers=tuple(addresses), **VARIANTS[v]))
                       for v in variants}
            for c in clients.values():  # warm-up: routing, RTT probes, first bandwidth samples, first-touch costs
                run_requests(c, workload(2, 10.0, args.long_tokens, args.short_tokens, 0.5, 3, 400, seed=99))
            rounds: dict[str, list[dict]] = {v: [] for v in variants}
            for k in range(args.rounds):
                reqs = workload(args.requests, args.rate, args.long_tokens, args.short_tokens, args.long_share,
                                args.new_tokens, 400, seed=k)
                order = variants[k % len(variants):] + variants[:k % len(variants)]
                for v in order:
                    rounds[v].append(run_requests(clients[v], reqs))
                    s = summarise(rounds[v][-1:])
                    print(f"[{network}] round {k} {v:13s} ttft p50 {s['ttft_p50_s']:.3f}s  tpot p50 "
                          f"{s['tpot_p50_s'] * 1e3:.1f}ms p90 {s['tpot_p90_s'] * 1e3:.1f}ms  "
                          f"{s['throughput_tok_s']:.1f} tok/s", flush=True)
            estimates = {v: {a: c.remote.channels.bandwidth(a) for a in addresses} for v, c in clients.items()}
            bw = {v: {a: (e.bandwidth_bps, e.measured) for a, e in per.items()} for v, per in estimates.items()}
            links = {v: {a: asdict(l.stats) | {"written": {k.value: n for k, n in l.stats.written.items()}}
                         for a, l in c.remote.channels.links.items()} for v, c in clients.items()}
            report["networks"][network] = {"info": info, "bandwidth_estimates": bw, "links": links,
                                           "summary": {v: summarise(rounds[v]) for v in variants}, "rounds": rounds}
            for c in clients.values():
                c.close()
        print_table(network, report["networks"][network]["summary"])
    (out / "molink_bench.json").write_text(json.dumps({"machine": machine_info(), **report}, indent=1, default=str))


def print_table(network: str, summary: dict) -> None:
    base = summary.get("baseline")
    print(f"\n{network}\n| variant | TTFT p50 (s) | TTFT p90 (s) | short-prompt TTFT p50 (s) | TPOT p50 (ms) | "
          f"TPOT p90 (ms) | throughput (tok/s) | TPOT p50 vs baseline |")
    print("|---|---|---|---|---|---|---|---|")
    for v, s in summary.items():
        rel = f"{(s['tpot_p50_s'] / base['tpot_p50_s'] - 1) * 100:+.1f}%" if base else ""
        short = f"{s['short_ttft_p50_s']:.3f}" if s["short_ttft_p50_s"] is not None else "-"
        print(f"| {v} | {s['ttft_p50_s']:.3f} | {s['ttft_p90_s']:.3f} | {short} | {s['tpot_p50_s'] * 1e3:.1f} | "
              f"{s['tpot_p90_s'] * 1e3:.1f} | {s['throughput_tok_s']:.1f} | {rel} |")


if __name__ == "__main__":
    main()
