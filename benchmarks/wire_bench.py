"""Compressed hidden states on a slow link: TTFT and TPOT per wire dtype, side by side on one emulated network.

One netem testbed (`--network wan`: 50 ms RTT and 100 Mbit/s on every link; namespaces with tbf and the delaying
relay when we have the rights, as `swarmlm bench --network wan`) and one swarm of N servers on it, shared by one
client per wire dtype (ClientConfig.wire_dtype). Rounds interleave the dtypes (their order rotates every round) so
machine noise hits all alike; every client generates for the same prompts; medians over rounds x prompts.

    .venv/bin/python benchmarks/wire_bench.py [--preset bloomz-560m] [--servers 2] [--network wan|50ms/10mbit|FILE]
        [--wire-dtypes float32,float16,int8,auto] [--prompt-tokens 256] [--new-tokens 16] [--prompts 2] [--rounds 3]

Per request: TTFT (generate()'s clock from the call to the first token: opening the streams, the prefill through
the chain, the head), TPOT (the rest of the request per further token), and the hidden-state bytes the client
wrote and read (the tensors' payload in the dtype sent). What each client sends per link for a prompt and for a
decode step (for `auto`: its choice by the link's measured bandwidth and the message's size), and the bandwidth it
measured there (client/chunking.py BandwidthEstimate).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from swarmlm.bench.runner import BenchConfig, start_swarm
from swarmlm.bench.strategies import StrategyConfig
from swarmlm.client.remote_cache import GenerationStats
from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.machine import machine_info
from swarmlm.model.checkpoint import load_config
from swarmlm.model.presets import get_preset
from swarmlm.model.random_checkpoint import default_checkpoint
from swarmlm.wire import compress


def wire_bytes(values: int, dtype: str) -> int:
    """Payload bytes of `values` hidden-state numbers sent as `dtype` (wire/compress.py)."""
    if dtype == "int8":
        return compress.packed_bytes(values)
    return values * {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]


def one_request(model: DistributedModelForCausalLM, ids: torch.Tensor, new_tokens: int) -> dict:
    stats = GenerationStats()
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, stats=stats)
    channels = model.remote.channels
    hidden = int(model.config.hidden_size)
    address = {sid: r.address for sid, r in model.remote.view.records.items()}

    def dtype(server_id: str, values: int) -> str:
        """What this client sends that server now: the setting, or auto's choice by the link's measured bandwidth
        and the message's size."""
        return channels.wire_dtype_for(address[server_id], 4 * values) if server_id in address else "float32"

    sent = sum(2 * wire_bytes(n, dtype(hop.server_id, n))  # request + reply of every hop
               for step in stats.steps for hop in step.hops for n in [hop.n_tokens * ids.shape[0] * hidden])
    prompt_values = ids.numel() * hidden
    decode_s = stats.total_s - stats.ttft_s
    return {
        "ttft_s": stats.ttft_s, "open_s": stats.open_s, "tpot_s": decode_s / (stats.new_tokens - 1),
        "new_tokens": stats.new_tokens, "tokens": out[0, ids.shape[1]:].tolist(), "hidden_bytes": sent,
        "chosen": {"prompt": {sid: dtype(sid, prompt_values) for sid in address},
                   "decode": {sid: dtype(sid, ids.shape[0] * hidden) for sid in address}},
        "measured_bps": {r.address: channels.bandwidth(r.address).bandwidth_bps
                         if channels.bandwidth(r.address).measured else None
                         for r in model.remote.view.records.values()},
    }


def _chosen(rec: dict) -> str:
    """'prompt: float16, decode: float32' (the formats over all servers)."""
    return ", ".join(f"{kind}: {'/'.join(sorted(set(by_server.values())))}"
                     for kind, by_server in rec["chosen"].items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bloomz-560m")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--network", default="wan",
                    help="lan | wan | '50ms/10mbit' | a topology file (as swarmlm bench --network)")
    ap.add_argument("--netem-mode", default="auto", choices=["auto", "namespaces", "relay-only"])
    ap.add_argument("--wire-dtypes", default="float32,float16,int8,auto")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per client per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="docs/results/wire-wan.json")
    args = ap.parse_args()
    dtypes = [d for d in args.wire_dtypes.split(",") if d]
    for d in dtypes:
        compress.check_wire_dtype(d)
    torch.set_num_threads(1)
    model_dir = str(default_checkpoint(args.preset))
    num_blocks = int(load_config(model_dir).num_hidden_layers)
    vocab = get_preset(args.preset).tokenizer_vocab or int(load_config(model_dir).vocab_size)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, vocab, (1, args.prompt_tokens), generator=gen) for _ in range(args.prompts)]
    cfg = BenchConfig(model_dir=model_dir, servers=(args.servers,), strategies=(StrategyConfig("sequential"),),
                      network=args.network, netem_mode=args.netem_mode)
    load = [os.getloadavg()]
    samples: dict[str, list[dict]] = {d: [] for d in dtypes}
    with start_swarm(cfg, args.servers, num_blocks) as swarm:
        clients = {d: DistributedModelForCausalLM.from_pretrained(model_dir, servers=swarm.server_addresses,
                                                                  routing="shortest", wire_dtype=d)
                   for d in dtypes}
        try:
            for d in dtypes:  # warm-up: channels, routing, and a first measurement of each link for auto
                one_request(clients[d], prompts[0], 4)
            for r in range(args.rounds):
                order = dtypes[r % len(dtypes):] + dtypes[:r % len(dtypes)]
                for p, ids in enumerate(prompts):
                    for d in order:
                        rec = one_request(clients[d], ids, args.new_tokens)
                        rec.update(round=r, prompt=p)
                        samples[d].append(rec)
                        print(f"round {r} prompt {p} {d:9s} TTFT {rec['ttft_s'] * 1e3:8.1f} ms  "
                              f"TPOT {rec['tpot_s'] * 1e3:7.1f} ms  sends {_chosen(rec)}", flush=True)
                load.append(os.getloadavg())
        finally:
            for c in clients.values():
                c.close()
        network_info = swarm.network_info
    ref = {(s["round"], s["prompt"]): s["tokens"] for s in samples.get("float32", [])}
    rows = {}
    for d, recs in samples.items():
        rows[d] = {
            "ttft_ms": statistics.median(s["ttft_s"] for s in recs) * 1e3,
            "tpot_ms": statistics.median(s["tpot_s"] for s in recs) * 1e3,
            "open_ms": statistics.median(s["open_s"] for s in recs) * 1e3,
            "hidden_bytes_per_request": statistics.median(s["hidden_bytes"] for s in recs),
            "chosen": sorted({_chosen(s) for s in recs}),
            "measured_mbps": sorted({round(v / 1e6, 1) for s in recs for v in s["measured_bps"].values() if v}),
            # greedy tokens against the float32 client's for the same prompt and round
            "same_tokens_as_float32": sum(s["tokens"] == ref.get((s["round"], s["prompt"])) for s in recs)
            if ref else None, "requests": len(recs),
        }
    base = rows.get("float32")
    result = {"machine": machine_info(), "threads": "1 torch thread per process",
              "command": "benchmarks/wire_bench.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in
                                                                 vars(args).items()),
              "load_avg_1_5_15": load, "network_info": network_info, "rows": rows, "samples": samples}
    print(f"\n{args.preset}, N={args.servers}, --network {args.network} ({network_info.get('mode')}), "
          f"{args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, medians of {args.rounds} rounds x "
          f"{args.prompts} prompts; load {load[0][0]:.2f} -> {load[-1][0]:.2f}")
    print("| wire dtype | TTFT ms | vs float32 | TPOT ms | vs float32 | hidden bytes/request | sent as | "
          "same tokens as float32 |")
    print("|---|---|---|---|---|---|---|---|")
    for d, row in rows.items():
        vs = (lambda k: f"{row[k] / base[k]:.3f}x") if base else (lambda k: "-")
        print(f"| {d} | {row['ttft_ms']:.0f} | {vs('ttft_ms')} | {row['tpot_ms']:.1f} | {vs('tpot_ms')} | "
              f"{row['hidden_bytes_per_request'] / 2**20:.2f} MiB | {'; '.join(row['chosen'])} | "
              f"{row['same_tokens_as_float32']}/{row['requests']} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
