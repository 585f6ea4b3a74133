"""Per-token decode latency through N = 1, 2, 4 loopback servers against the same model in one process.

Side by side in one run: the swarms for every N are up at once and the rounds interleave local / N=1 / N=2 / N=4,
so machine noise hits all of them alike; medians over rounds. Usage:

    .venv/bin/python benchmarks/overhead.py [--presets tiny-bloom,bloomz-560m] [--rounds 5] [--tokens 32]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicCache

from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.model.checkpoint import load_config
from swarmlm.model.init import default_checkpoint
from swarmlm.swarm.local import LocalSwarm, even_split

PROMPT = list(range(10, 26))  # 16 tokens


@torch.inference_mode()
def local_per_token_s(model, tokens: int) -> float:
    """Plain transformers, one process: a prefill, then `tokens` single-token steps with its own cache."""
    cache = DynamicCache()
    ids = torch.tensor([PROMPT])
    out = model(ids, cache=cache, use_cache=True)
    times = []
    for _ in range(tokens):
        nxt = out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        out = model(nxt, cache=cache, use_cache=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def swarm_per_token_s(client: DistributedModelForCausalLM, tokens: int) -> tuple[float, float]:
    """Median decode step (embeddings + chain + head) and median per-hop time outside the servers' own work."""
    ids = torch.tensor([PROMPT])
    times, hop_overheads = [], []
    with client.inference_session(max_length=len(PROMPT) + tokens + 1) as session:
        logits = client.step_logits(session, ids)
        for _ in range(tokens):
            nxt = logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            logits = client.step_logits(session, nxt)
            times.append(time.perf_counter() - t0)
            hops = session.steps[-1].hops
            hop_overheads.extend(h.wall_s - h.compute_s - h.queued_s + h.client_io_s for h in hops)
    return statistics.median(times), statistics.median(hop_overheads)


def run_preset(preset: str, ns: list[int], rounds: int, tokens: int) -> dict:
    model_dir = str(default_checkpoint(preset))
    num_blocks = int(load_config(model_dir).num_hidden_layers)
    torch.set_num_threads(1)
    local = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    swarms, clients = {}, {}
    try:
        for n in ns:
            swarms[n] = LocalSwarm(model_dir, threads=1).start(even_split(num_blocks, n))
            # a direct server list: the same chain every time, no DHT in the measured path
            clients[n] = DistributedModelForCausalLM.from_pretrained(
                model_dir, servers=swarms[n].addresses, routing="shortest")
            swarm_per_token_s(clients[n], 4)  # warm up channels
        local_per_token_s(local, 4)
        samples: dict[str, list[float]] = {"local": []}
        overheads: dict[int, list[float]] = {n: [] for n in ns}
        for n in ns:
            samples[f"N={n}"] = []
        for _ in range(rounds):
            samples["local"].append(local_per_token_s(local, tokens))
            for n in ns:
                step, hop = swarm_per_token_s(clients[n], tokens)
                samples[f"N={n}"].append(step)
                overheads[n].append(hop)
    finally:
        for c in clients.values():
            c.close()
        for s in swarms.values():
            s.stop()
    base = statistics.median(samples["local"])
    rows = {"local": {"per_token_ms": base * 1e3}}
    for n in ns:
        med = statistics.median(samples[f"N={n}"])
        rows[f"N={n}"] = {
            "per_token_ms": med * 1e3,
            "added_ms": (med - base) * 1e3,
            "added_per_hop_ms": (med - base) * 1e3 / n,
            "hop_overhead_ms": statistics.median(overheads[n]) * 1e3,  # wire + gRPC + (de)serialisation per hop
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--presets", default="tiny-bloom,bloomz-560m")
    parser.add_argument("--servers", default="1,2,4")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", default="docs/results/overhead.json")
    args = parser.parse_args()
    ns = [int(x) for x in args.servers.split(",")]
    results = {"machine": f"{platform.machine()} {platform.processor() or ''} {torch.get_num_threads()} thread",
               "cores": __import__("os").cpu_count(), "rounds": args.rounds, "tokens": args.tokens, "presets": {}}
    for preset in args.presets.split(","):
        results["presets"][preset] = run_preset(preset, ns, args.rounds, args.tokens)
        print(f"\n{preset} (median of {args.rounds} rounds x {args.tokens} decode steps, 1 thread per process)")
        print("| setup | ms/token | added vs local | added per hop | per-hop wire+gRPC |")
        print("|---|---|---|---|---|")
        for name, row in results["presets"][preset].items():
            print(f"| {name} | {row['per_token_ms']:.2f} | {row.get('added_ms', 0):+.2f} | "
                  f"{row.get('added_per_hop_ms', 0):+.2f} | {row.get('hop_overhead_ms', 0):.2f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
