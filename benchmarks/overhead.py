"""Per-token decode latency through N = 1, 2, 4 loopback servers against the same model in one process.

Side by side in one run: the swarms for every N are up at once and the rounds interleave local / N=1 / N=2 / N=4
(and, with --int8 N..., int8 swarms: servers --quant int8 and the client's head + embeddings in int8), so machine
noise hits all of them alike; medians over rounds. Usage:

    .venv/bin/python benchmarks/overhead.py [--presets tiny-bloom,bloomz-560m] [--rounds 5] [--tokens 32]
        [--int8 1,2] [--accuracy-prompts 8] [--push 2,4]

--handoff N...: also swarms of N servers whose lone decode steps go to the compute thread (`--inline-decode-max-ms
0`: the hand-off the default skips, server/scheduler.py), side by side with the default.

--push N...: also swarms of N servers with server-to-server push (ClientConfig.push: each server sends its output
straight on to the next, so a token is N + 1 messages instead of N round trips through the client).

"local" is plain transformers with its weights copied into the process's memory, as swarmlm's servers and client
hold theirs; "local mmap" is the same model as `from_pretrained` leaves it (weights as views of the safetensors
file's mapping), which reads them ~1.5x slower on the machine we measured (docs/RESULTS-perf.md). The swarm is
compared with "local", the faster of the two.

--int8 also reports each server's weight bytes and resident memory (fp32 vs int8 swarms of the same N), and with
--accuracy-prompts K, int8 against fp32 over K prompts: the prompt's logits' relative L2 and how many of the first
32 greedy tokens agree (up to the first difference).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicCache

from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.machine import machine_info
from swarmlm.model.checkpoint import load_config
from swarmlm.model.random_checkpoint import default_checkpoint
from swarmlm.swarm.local import LocalSwarm, even_split

PROMPT = list(range(10, 26))  # 16 tokens


def in_process_memory(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every weight copied out of the checkpoint file's mapping (tied weights stay tied: they are one
    Parameter)."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    return model


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


PROMPTS = [list(range(10 + 7 * k, 26 + 7 * k)) for k in range(16)]  # 16-token prompts for the accuracy check


def _server_memory(swarm: LocalSwarm, client: DistributedModelForCausalLM) -> list[dict]:
    import psutil

    records = {r.address: r for r in client.remote.view.records.values()}
    out = []
    for s in swarm.servers:
        r = records.get(s.address)
        out.append({"blocks": [r.start, r.end] if r else None, "quant": r.quant if r else None,
                    "weight_bytes": r.weight_bytes if r else None, "rss_bytes": psutil.Process(s.proc.pid).memory_info().rss})
    return out


def _accuracy(fp32: DistributedModelForCausalLM, int8: DistributedModelForCausalLM, prompts: int) -> dict:
    """int8 swarm vs fp32 swarm: prompt logits' relative L2, and greedy agreement on the first 32 new tokens."""
    rel, agree = [], []
    for ids in PROMPTS[:prompts]:
        x = torch.tensor([ids])
        a, b = fp32(x).logits, int8(x).logits
        rel.append(float((b - a).norm() / a.norm()))
        ga = fp32.generate(x, max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
        gb = int8.generate(x, max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
        same = next((i for i, (p, q) in enumerate(zip(ga, gb)) if p != q), min(len(ga), len(gb)))
        agree.append(same)
    return {"prompts": prompts, "logits_rel_l2_median": statistics.median(rel), "logits_rel_l2_max": max(rel),
            "greedy_tokens_agreeing": agree, "all_32_agree": sum(a >= 32 for a in agree)}


def run_preset(preset: str, ns: list[int], rounds: int, tokens: int, int8_ns: list[int] = (),
               accuracy_prompts: int = 0, push_ns: list[int] = (), handoff_ns: list[int] = ()) -> dict:
    model_dir = str(default_checkpoint(preset))
    num_blocks = int(load_config(model_dir).num_hidden_layers)
    torch.set_num_threads(1)
    local = in_process_memory(AutoModelForCausalLM.from_pretrained(model_dir).eval())
    local_mmap = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    setups = ([(f"N={n}", n, "none") for n in ns] + [(f"N={n} int8", n, "int8") for n in int8_ns]
              + [(f"N={n} push", n, "none") for n in push_ns] + [(f"N={n} handoff", n, "none") for n in handoff_ns])
    swarms, clients = {}, {}
    extra: dict = {}
    try:
        for name, n, quant in setups:
            handoff = ["--inline-decode-max-ms", "0"] if name.endswith("handoff") else []
            swarms[name] = LocalSwarm(model_dir, threads=1, server_args=["--quant", quant, *handoff]).start(
                even_split(num_blocks, n))
            # a direct server list: the same chain every time, no DHT in the measured path
            clients[name] = DistributedModelForCausalLM.from_pretrained(
                model_dir, servers=swarms[name].addresses, routing="shortest", quant=quant, push=name.endswith("push"))
            swarm_per_token_s(clients[name], 4)  # warm up channels
        local_per_token_s(local, 4)
        local_per_token_s(local_mmap, 4)
        samples: dict[str, list[float]] = {"local": [], "local mmap": [], **{name: [] for name, _, _ in setups}}
        overheads: dict[str, list[float]] = {name: [] for name, _, _ in setups}
        for _ in range(rounds):
            samples["local"].append(local_per_token_s(local, tokens))
            samples["local mmap"].append(local_per_token_s(local_mmap, tokens))
            for name, _, _ in setups:
                step, hop = swarm_per_token_s(clients[name], tokens)
                samples[name].append(step)
                overheads[name].append(hop)
        if int8_ns:
            extra["memory"] = {name: _server_memory(swarms[name], clients[name]) for name, _, _ in setups}
            n = int8_ns[0]
            if accuracy_prompts and f"N={n}" in clients:
                extra["accuracy"] = _accuracy(clients[f"N={n}"], clients[f"N={n} int8"], accuracy_prompts)
    finally:
        for c in clients.values():
            c.close()
        for s in swarms.values():
            s.stop()
    base = statistics.median(samples["local"])
    rows = {"local": {"per_token_ms": base * 1e3}}
    mmap_med = statistics.median(samples["local mmap"])
    rows["local mmap"] = {"per_token_ms": mmap_med * 1e3, "vs_local": mmap_med / base}
    for name, n, _ in setups:
        med = statistics.median(samples[name])
        rows[name] = {
            "per_token_ms": med * 1e3,
            "vs_local": med / base,
            "added_ms": (med - base) * 1e3,
            "added_per_hop_ms": (med - base) * 1e3 / n,
            "hop_overhead_ms": statistics.median(overheads[name]) * 1e3,  # wire + gRPC + (de)serialisation per hop
        }
    return {"rows": rows, **extra}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="tiny-bloom,bloomz-560m")
    parser.add_argument("--servers", default="1,2,4")
    parser.add_argument("--int8", default="", help="swarm sizes to run with int8 servers + head as well, e.g. 1,2")
    parser.add_argument("--push", default="", help="swarm sizes to run with server-to-server push as well, e.g. 4")
    parser.add_argument("--handoff", default="",
                        help="swarm sizes to run with lone decode steps handed to the compute thread as well, e.g. 4")
    parser.add_argument("--accuracy-prompts", type=int, default=0, help="int8 vs fp32 on this many prompts")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", default="docs/results/overhead.json")
    args = parser.parse_args()
    ns = [int(x) for x in args.servers.split(",") if x]
    int8_ns = [int(x) for x in args.int8.split(",") if x]
    push_ns = [int(x) for x in args.push.split(",") if x]
    handoff_ns = [int(x) for x in args.handoff.split(",") if x]
    results = {"machine": machine_info(), "threads": "1 torch thread per process", "rounds": args.rounds, "tokens": args.tokens, "presets": {}}
    for preset in args.presets.split(","):
        res = results["presets"][preset] = run_preset(preset, ns, args.rounds, args.tokens, int8_ns,
                                                      args.accuracy_prompts, push_ns, handoff_ns)
        print(f"\n{preset} (median of {args.rounds} rounds x {args.tokens} decode steps, 1 thread per process)")
        print("| setup | ms/token | vs local | added vs local | added per hop | per-hop wire+gRPC |")
        print("|---|---|---|---|---|---|")
        for name, row in res["rows"].items():
            print(f"| {name} | {row['per_token_ms']:.2f} | {row.get('vs_local', 1.0):.3f}x | {row.get('added_ms', 0):+.2f} | "
                  f"{row.get('added_per_hop_ms', 0):+.2f} | {row.get('hop_overhead_ms', 0):.2f} |")
        for name, servers in res.get("memory", {}).items():
            print(f"memory {name}: " + "; ".join(
                f"blocks {m['blocks']} {m['quant']}: weights {m['weight_bytes'] / 2**20:.0f} MiB, "
                f"RSS {m['rss_bytes'] / 2**20:.0f} MiB" for m in servers))
        if "accuracy" in res:
            print("accuracy int8 vs fp32:", json.dumps(res["accuracy"]))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))  # after each preset: a partial run is kept


if __name__ == "__main__":
    main()
