"""What the HTTP gateway costs: streaming HTTP clients vs the same sessions driven through the Python API.

One swarm (DHT + servers), one `swarmlm api` process. For each concurrency C, C greedy generations run at once,
alternately (A/B, several rounds) through
  - python: C threads in this process, each `model.generate()` (its own inference session);
  - http:   C threads, each a streaming POST /v1/completions to the gateway (its own session there);
and report aggregate tokens/s, TTFT and TPOT p50/p90 (medians over rounds), and http / python throughput.

    python benchmarks/api_bench.py [--preset small-bloom] [--servers 2] [--concurrency 1 4 16] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from dataclasses import dataclass

import httpx2 as httpx
import torch
from transformers import AutoTokenizer

from swarmlm.api.process import GatewayProcess
from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.machine import machine_info
from swarmlm.model.checkpoint import load_config
from swarmlm.model.random_checkpoint import default_checkpoint
from swarmlm.stats import percentile
from swarmlm.swarm.local import LocalSwarm, even_split

PROMPTS = ["The quick brown fox jumps over the lazy dog while", "Distributed inference splits a large language model",
           "What is the capital of France?", "Water boils at one hundred degrees", "Machine learning models learn",
           "The library opens at nine in the morning", "In 1969, astronauts landed on the moon",
           "A good recipe lists its ingredients first"]


@dataclass
class Stream:
    tokens: int = 0
    ttft_s: float = 0.0
    total_s: float = 0.0

    @property
    def tpot_s(self) -> float | None:
        return (self.total_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else None


def run_python(model, tokenizer, prompts: list[str], max_tokens: int) -> list[Stream]:
    out: list[Stream] = [Stream() for _ in prompts]

    # the same loop as the gateway's engine (a session per stream, greedy, stop at eos), without HTTP
    def one_timed(i: int) -> None:
        ids = tokenizer(prompts[i], return_tensors="pt").input_ids
        t0 = time.perf_counter()
        s = Stream()
        with model.inference_session(max_length=ids.shape[1] + max_tokens, l_in_hint=ids.shape[1],
                                     l_out_hint=max_tokens) as session:
            step = ids
            for n in range(max_tokens):
                logits = model.step_logits(session, step, None, last_only=True)
                token = logits[:, -1].argmax(dim=-1, keepdim=True)
                if n == 0:
                    s.ttft_s = time.perf_counter() - t0
                if int(token) in model.eos_token_id:  # not counted: the gateway sends no chunk for it
                    break
                s.tokens += 1
                step = token
        s.total_s = time.perf_counter() - t0
        out[i] = s

    threads = [threading.Thread(target=one_timed, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def run_http(clients: list[httpx.Client], url: str, model_name: str, prompts: list[str],
             max_tokens: int) -> list[Stream]:
    """clients: one per stream, made before: creating an httpx client (its TLS context) took 0.13-0.3 s of CPU
    on this machine, a cost of the benchmark, not of the gateway."""
    out: list[Stream] = [Stream() for _ in prompts]

    def one(i: int) -> None:
        body = {"model": model_name, "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0, "stream": True}
        s = Stream()
        t0 = time.perf_counter()
        with clients[i].stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                # one chunk per generated token (no stop strings here); a substring test, not json.loads: the
                # clients share this machine's 2 cores with the gateway and the servers
                if line.startswith("data: {") and '"finish_reason":null' in line:
                    s.tokens += 1
                    if s.tokens == 1:
                        s.ttft_s = time.perf_counter() - t0
        s.total_s = time.perf_counter() - t0
        out[i] = s

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def summarize(streams: list[Stream], wall_s: float) -> dict:
    tpot = [s.tpot_s for s in streams if s.tpot_s is not None]
    return {
        "tokens_per_s": sum(s.tokens for s in streams) / wall_s,
        "ttft_p50_s": percentile([s.ttft_s for s in streams], 50),
        "ttft_p90_s": percentile([s.ttft_s for s in streams], 90),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p90_s": percentile(tpot, 90),
    }


def timed(fn, *args) -> tuple[list[Stream], float]:
    t0 = time.perf_counter()
    streams = fn(*args)
    return streams, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-bloom")
    ap.add_argument("--model", help="a checkpoint directory instead of --preset's cached one")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="servers', gateway's and python client's --dtype (e.g. bfloat16)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rounds", type=int, default=3, help="A/B rounds per concurrency (medians reported)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)

    model_dir = args.model or str(default_checkpoint(args.preset))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    swarm = LocalSwarm(model_dir, server_args=["--dtype", args.dtype])
    rows = []
    try:
        swarm.start(even_split(int(load_config(model_dir).num_hidden_layers), args.servers))
        model = DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers,
                                                            dtype=args.dtype)
        with GatewayProcess(model_dir, swarm.initial_peers,
                            extra=["--max-streams-per-client", "1024", "--dtype", args.dtype]) as gateway:
            clients = [httpx.Client() for _ in range(max(args.concurrency))]
            warm = [PROMPTS[i % len(PROMPTS)] for i in range(len(clients))]
            run_python(model, tokenizer, warm[:2], 4)
            run_http(clients, gateway.url, model_dir, warm, 4)  # every client connected once
            for c in args.concurrency:
                prompts = [PROMPTS[i % len(PROMPTS)] for i in range(c)]
                results: dict[str, list[dict]] = {"python": [], "http": []}
                for r in range(args.rounds):
                    order = [("python", lambda: run_python(model, tokenizer, prompts, args.max_tokens)),
                             ("http", lambda: run_http(clients, gateway.url, model_dir, prompts, args.max_tokens))]
                    for name, fn in (order if r % 2 == 0 else order[::-1]):  # alternate who goes first
                        streams, wall_s = timed(fn)
                        results[name].append(summarize(streams, wall_s))
                row = {"concurrency": c}
                for name, runs in results.items():
                    for k in runs[0]:
                        row[f"{name}_{k}"] = statistics.median(x[k] for x in runs)
                row["http_over_python"] = row["http_tokens_per_s"] / row["python_tokens_per_s"]
                rows.append(row)
                print(json.dumps(row), flush=True)
        model.close()
    finally:
        swarm.stop()
    print(f"\n{args.preset if not args.model else model_dir}, {args.servers} servers, dtype {args.dtype}, "
          f"{args.max_tokens} new tokens, "
          f"{args.rounds} A/B rounds (medians)")
    print("| C | python tok/s | http tok/s | http/python | TTFT p50/p90 python (ms) | TTFT p50/p90 http (ms) "
          "| TPOT p50/p90 python (ms) | TPOT p50/p90 http (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ms = lambda k: f"{r[k] * 1000:.1f}"  # noqa: E731
        print(f"| {r['concurrency']} | {r['python_tokens_per_s']:.1f} | {r['http_tokens_per_s']:.1f} | "
              f"{r['http_over_python']:.3f} | {ms('python_ttft_p50_s')} / {ms('python_ttft_p90_s')} | "
              f"{ms('http_ttft_p50_s')} / {ms('http_ttft_p90_s')} | {ms('python_tpot_p50_s')} / "
              f"{ms('python_tpot_p90_s')} | {ms('http_tpot_p50_s')} / {ms('http_tpot_p90_s')} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
