"""Server-to-server push against client-relayed routes: per-token decode latency, side by side in one run.

For each N a fresh swarm (even split) on emulated hosts whose every link has the given RTT (netem testbed), two
clients on it (push off / on), greedy decoding of the same prompt, in interleaved rounds (the order alternates so
background load hits both alike). A token crosses 2N links relayed and N + 1 pushed, so the gap expected from the
network alone is (N - 1) one-way delays.

    .venv/bin/python benchmarks/push_bench.py --servers 2,4 --network 20ms --rounds 5 --tokens 24

Per-token latency = the client's wall time of one decode step through the chain (session.steps[i].wall_s), and
with the LM head and sampling (`step_logits`); medians and p90 over all decode steps of all rounds.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from swarmlm.bench.netem.profile import inline_profile
from swarmlm.bench.runner import BenchConfig, start_swarm
from swarmlm.bench.strategies import StrategyConfig
from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.machine import machine_info
from swarmlm.model.random_checkpoint import init_checkpoint

MODES = {"relay": False, "push": True}


def decode_latencies(client: DistributedModelForCausalLM, prompt: torch.Tensor, tokens: int) -> dict:
    """One session: prefill, then `tokens` greedy decode steps; per step the chain's wall time and the caller's."""
    calls, pushed = [], 0
    with torch.no_grad(), client.inference_session(max_length=prompt.shape[1] + tokens + 1) as session:
        logits = client.step_logits(session, prompt)
        for _ in range(tokens):
            nxt = logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            logits = client.step_logits(session, nxt)
            calls.append(time.perf_counter() - t0)
        chain = [s.wall_s for s in session.steps[1:]]
        pushed = sum(h.pushed for s in session.steps for h in s.hops)
        failovers = sum(s.failovers for s in session.steps)
    return {"chain_s": chain, "call_s": calls, "pushed_hops": pushed, "failovers": failovers}


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, round(q * (len(v) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small-bloom")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--servers", default="2,4")
    ap.add_argument("--network", default="20ms", help="loopback, a preset (lan, wan) or an inline RTT like 20ms")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=24, help="decode steps per session")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--out", default="out/push")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = str(init_checkpoint(args.preset, Path("out/checkpoints") / f"{args.preset}-{args.layers}l", seed=0,
                                    num_layers=args.layers))
    vocab = int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    prompt = torch.randint(3, vocab, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    profile = inline_profile(args.network)
    one_way_s = profile.one_way_s if profile else None
    report = {"args": vars(args), "machine": machine_info() | {"platform": platform.platform()}, "runs": []}
    for n in (int(x) for x in args.servers.split(",")):
        cfg = BenchConfig(model_dir=model_dir, servers=(n,), strategies=(StrategyConfig("sequential"),),
                          network=args.network)
        with start_swarm(cfg, n, args.layers) as swarm:
            clients = {m: DistributedModelForCausalLM.from_pretrained(
                model_dir, initial_peers=swarm.initial_peers, servers=swarm.server_addresses, push=p)
                for m, p in MODES.items()}
            try:
                for c in clients.values():  # warm-up: channels, routing, first-touch costs
                    decode_latencies(c, prompt, 4)
                rounds = {m: [] for m in MODES}
                for k in range(args.rounds):
                    for m in (list(MODES) if k % 2 == 0 else list(MODES)[::-1]):
                        rounds[m].append(decode_latencies(clients[m], prompt, args.tokens))
                    print(f"N={n} round {k}: " + "  ".join(
                        f"{m} {statistics.median(rounds[m][-1]['chain_s']) * 1e3:.1f} ms" for m in MODES), flush=True)
            finally:
                for c in clients.values():
                    c.close()
        row = {"servers": n, "network": args.network, "network_info": swarm.network_info}
        for m in MODES:
            chain = [x for r in rounds[m] for x in r["chain_s"]]
            call = [x for r in rounds[m] for x in r["call_s"]]
            row[m] = {"chain_p50_s": statistics.median(chain), "chain_p90_s": pct(chain, 0.9),
                      "call_p50_s": statistics.median(call), "call_p90_s": pct(call, 0.9),
                      "pushed_hops": sum(r["pushed_hops"] for r in rounds[m]),
                      "failovers": sum(r["failovers"] for r in rounds[m]), "steps": len(chain)}
        row["push_vs_relay_chain_p50"] = row["push"]["chain_p50_s"] / row["relay"]["chain_p50_s"]
        row["saved_p50_s"] = row["relay"]["chain_p50_s"] - row["push"]["chain_p50_s"]
        row["expected_saving_s"] = (n - 1) * one_way_s if one_way_s is not None else None
        report["runs"].append(row)
    (out / "push_bench.json").write_text(json.dumps(report, indent=1))
    print(table(report["runs"]))


def table(runs: list[dict]) -> str:
    lines = ["| N | network | relayed: per token p50 / p90 (ms) | pushed: p50 / p90 (ms) | pushed / relayed | "
             "saved p50 (ms) | expected from the links (ms) |", "|---|---|---|---|---|---|---|"]
    for r in runs:
        exp = f"{r['expected_saving_s'] * 1e3:.0f}" if r["expected_saving_s"] is not None else "-"
        lines.append(f"| {r['servers']} | {r['network']} | {r['relay']['chain_p50_s'] * 1e3:.1f} / "
                     f"{r['relay']['chain_p90_s'] * 1e3:.1f} | {r['push']['chain_p50_s'] * 1e3:.1f} / "
                     f"{r['push']['chain_p90_s'] * 1e3:.1f} | {r['push_vs_relay_chain_p50']:.2f} | "
                     f"{r['saved_p50_s'] * 1e3:.1f} | {exp} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
