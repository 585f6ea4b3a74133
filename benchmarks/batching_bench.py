"""Continuous batching: decode throughput of N concurrent sessions on one server vs the same sessions one after
another.

Two levels, side by side in one run (modes alternate within every repeat, so machine noise hits all of them alike;
medians over repeats):
- stage: one process, a Stage holding every block; N sessions stepped one at a time (`step`) vs as one batch
  (`step_batch`).
- swarm: one real server process (LocalSwarm) and the real client; N sessions one after another vs N sessions
  from N threads at once, against a server with batching (defaults), one that batches without waiting for
  stragglers (--batch-wait 0) and one with batching off (--max-batch-tokens 1: same concurrency, one step per
  forward). Decode steps send the embedding of a fixed
  token through the client's session and skip the client's LM head: with bloomz-560m's 250,880-token vocabulary
  the head costs the client about as much as the server's 24 blocks, and this measures the server.

- generate: what a user sees. Real greedy `generate()` calls WITH the client's LM head (bloomz-560m: a 250,880 x
  1,024 matmul per token), against one server process holding every block of a checkpoint with the preset's
  shapes and `--gen-blocks` blocks (default 4); per quantization (`--quant none,int8`: the server's `--quant` and
  the client's `quant=`): N generations one after another, N at once from N threads of ONE client process (their
  heads batched by client/head_batcher.py), and N at once from N separate client processes (each its own head;
  only for N <= --max-processes, each process holds the client's embeddings + head: ~1 GB fp32). Tokens of every
  mode are checked equal to one after another's. "x" = median per-repeat ratio of tokens/s to one after another.

Sessions have different prompt lengths (8 + 3 i tokens), so batches mix past lengths. Usage:

    .venv/bin/python benchmarks/batching_bench.py [--presets tiny-bloom,bloomz-560m] [--sessions 1,4,16]
        [--repeats 3] [--tokens 8] [--levels stage,swarm,generate] [--quant none,int8] [--gen-blocks 4]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from swarmlm.client.remote_cache import GenerationStats
from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.machine import machine_info
from swarmlm.model.checkpoint import load_config
from swarmlm.model.random_checkpoint import default_checkpoint, init_checkpoint
from swarmlm.server.stage import Stage, StepRequest
from swarmlm.swarm.local import LocalSwarm
from swarmlm.types import BlockRange

TOKEN = 42  # the token every decode step feeds (its embedding; the next token does not matter for throughput)


def prompt_len(i: int) -> int:
    return 8 + 3 * i


# ---- stage level -------------------------------------------------------------------------------------------------
@torch.inference_mode()
def stage_tokens_per_s(stage: Stage, n: int, tokens: int, batched: bool) -> float:
    h = stage.hidden_size
    gen = torch.Generator().manual_seed(n)
    states = [stage.new_state(stage.blocks, 1) for _ in range(n)]
    for i, s in enumerate(states):
        stage.step(s, torch.randn(1, prompt_len(i), h, generator=gen), torch.ones(1, prompt_len(i), dtype=torch.long))
    one = torch.ones(1, 1, dtype=torch.long)
    xs = [[torch.randn(1, 1, h, generator=gen) for _ in states] for _ in range(tokens)]
    t0 = time.perf_counter()
    for step in xs:
        if batched:
            stage.step_batch([StepRequest(s, x, one) for s, x in zip(states, step)])
        else:
            for s, x in zip(states, step):
                stage.step(s, x, one)
    return n * tokens / (time.perf_counter() - t0)


def run_stage(model_dir: str, ns: list[int], repeats: int, tokens: int, blocks: int | None = None,
              quants: tuple[str, ...] = ("none",)) -> dict:
    """Per quantization (model/quant.py; "int8 batched" etc.), speedups against the first one's one-after-another."""
    span = BlockRange(0, blocks or int(load_config(model_dir).num_hidden_layers))
    stages = {q: Stage(model_dir, span, quant=q) for q in quants}
    for stage in stages.values():
        stage_tokens_per_s(stage, 2, 2, True)  # warm-up
    prefix = {q: "" if q == "none" else f"{q} " for q in quants}
    rows = {}
    for n in ns:
        modes = [(q, batched) for q in quants for batched in (False, True)]
        name = {m: prefix[m[0]] + ("batched" if m[1] else "one_after_another") for m in modes}
        samples: dict[str, list[float]] = {name[m]: [] for m in modes}
        for r in range(repeats):
            for m in (modes if r % 2 == 0 else modes[::-1]):  # alternating order: drifting load hits all alike
                samples[name[m]].append(stage_tokens_per_s(stages[m[0]], n, tokens, m[1]))
        rows[n] = _summary(samples, name[modes[0]])
    return rows


# ---- swarm level -------------------------------------------------------------------------------------------------
def _session_decode(client: DistributedModelForCausalLM, i: int, tokens: int, barrier: threading.Barrier | None,
                    spans: list, batches: list[int]) -> None:
    prompt = torch.full((1, prompt_len(i)), TOKEN)
    with client.inference_session(max_length=prompt_len(i) + tokens) as session:
        session.step(client.embed(prompt))
        x = client.embed(torch.tensor([[TOKEN]]))
        if barrier is not None:
            barrier.wait()  # every session has its prefill done: only decode steps are timed
        t0 = time.perf_counter()
        for _ in range(tokens):
            session.step(x)
        spans.append((t0, time.perf_counter()))
        batches.extend(h.batched_steps for step in session.steps[-tokens:] for h in step.hops)  # as the server saw it


def swarm_tokens_per_s(client: DistributedModelForCausalLM, n: int, tokens: int, concurrent: bool,
                       batches: list[int] | None = None) -> float:
    """Decode tokens/s of n sessions; `batches` receives the batch size the server reported for every step."""
    spans: list[tuple[float, float]] = []
    batches = [] if batches is None else batches
    if not concurrent:
        for i in range(n):
            _session_decode(client, i, tokens, None, spans, batches)
        return n * tokens / sum(end - start for start, end in spans)
    barrier = threading.Barrier(n)
    threads = [threading.Thread(target=_session_decode, args=(client, i, tokens, barrier, spans, batches))
               for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(spans) == n, "a session failed"
    return n * tokens / (max(end for _, end in spans) - min(start for start, _ in spans))


def run_swarm(model_dir: str, ns: list[int], repeats: int, tokens: int, blocks: int | None = None,
              unbatched: bool = True) -> dict:
    num_blocks = int(load_config(model_dir).num_hidden_layers)
    assert blocks in (None, num_blocks), "the swarm level serves every block (the client needs a full route)"
    swarms, clients = {}, {}
    try:
        servers = [("batching", []), ("no_wait", ["--batch-wait", "0"])] + (
            [("no_batching", ["--max-batch-tokens", "1"])] if unbatched else [])
        for name, args in servers:
            swarms[name] = LocalSwarm(model_dir, threads=1, with_dht=False,
                                      server_args=["--max-sessions", "64", *args]).start([BlockRange(0, num_blocks)])
            clients[name] = DistributedModelForCausalLM.from_pretrained(
                model_dir, servers=swarms[name].addresses, routing="shortest")
            swarm_tokens_per_s(clients[name], 2, 2, True)  # warm up channels and the server
        rows = {}
        for n in ns:
            samples: dict[str, list[float]] = {"one_after_another": [], "concurrent_batched": [],
                                               "concurrent_batched_no_wait": []}
            if unbatched:
                samples["concurrent_no_batching"] = []
            batches: dict[str, list[int]] = {mode: [] for mode in samples}
            for r in range(repeats):
                modes = list(samples) if r % 2 == 0 else list(reversed(samples))
                for mode in modes:
                    client = clients[{"concurrent_no_batching": "no_batching",
                                      "concurrent_batched_no_wait": "no_wait"}.get(mode, "batching")]
                    samples[mode].append(swarm_tokens_per_s(client, n, tokens, mode != "one_after_another",
                                                            batches[mode]))
            rows[n] = _summary(samples, "one_after_another")
            rows[n]["mean_server_batch"] = {mode: statistics.mean(b) for mode, b in batches.items()}
        return rows
    finally:
        for c in clients.values():
            c.close()
        for s in swarms.values():
            s.stop()


# ---- generate level ----------------------------------------------------------------------------------------------
# generate level --quant: the servers' and the client's (dtype, quant). bf16 runs the linear layers on the CPU's
# AMX/AVX-512 bf16 units where it has them (8-row LM head ~3x faster than fp32's sgemm here; docs/RESULTS-batching.md)
PRECISIONS = {"none": ("float32", "none"), "int8": ("float32", "int8"), "bf16": ("bfloat16", "none")}


def gen_checkpoint(preset: str, blocks: int | None) -> str:
    """The preset's checkpoint, or one with its shapes and only `blocks` blocks (created once, cached)."""
    if blocks is None:
        return str(default_checkpoint(preset))
    path = Path.home() / ".cache" / "swarmlm" / "checkpoints" / f"{preset}-{blocks}blocks-seed0"
    if not (path / "swarmlm.json").is_file():
        init_checkpoint(preset, path, num_layers=blocks)
    return str(path)


def gen_prompt(i: int) -> torch.Tensor:
    return torch.arange(5, 5 + prompt_len(i)).unsqueeze(0)  # token ids 5.. (any ids: random weights)


def generate_one(client: DistributedModelForCausalLM, i: int, tokens: int) -> dict:
    """One greedy generation of exactly `tokens` new tokens (no EOS stop); its tokens, clocks and server batches."""
    stats = GenerationStats()
    t0 = time.time()  # wall clock: comparable across processes
    out = client.generate(gen_prompt(i), max_new_tokens=tokens, do_sample=False, eos_token_id=None, stats=stats)
    t1 = time.time()
    decode = [h.batched_steps for step in stats.steps if step.n_tokens == 1 for h in step.hops]
    return {"start": t0, "end": t1, "tokens": out[0].tolist(), "server_batches": decode, "head_s": stats.head_s}


def worker_main(args) -> None:
    """A client process of the `processes` mode: loads the client, then per line of stdin (a prompt index)
    generates and prints one JSON line."""
    torch.set_num_threads(1)
    dtype, quant = PRECISIONS[args.worker_quant]
    client = DistributedModelForCausalLM.from_pretrained(args.worker_model, servers=[args.worker_server],
                                                         routing="shortest", quant=quant, dtype=dtype)
    generate_one(client, 0, 2)  # warm up
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        i, tokens = (int(x) for x in line.split())
        print(json.dumps(generate_one(client, i, tokens)), flush=True)
    client.close()


class Workers:
    """n client processes (started once, reused by every repeat)."""

    def __init__(self, n: int, model_dir: str, server: str, precision: str) -> None:
        cmd = [sys.executable, __file__, "--worker-model", model_dir, "--worker-server", server,
               "--worker-quant", precision]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
                      for _ in range(n)]
        for p in self.procs:
            line = p.stdout.readline()
            if not line or not json.loads(line).get("ready"):
                raise RuntimeError("a client process did not start")

    def run(self, tokens: int) -> list[dict]:
        for i, p in enumerate(self.procs):
            p.stdin.write(f"{i} {tokens}\n")
            p.stdin.flush()
        return [json.loads(p.stdout.readline()) for p in self.procs]

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def gen_round(mode: str, client: DistributedModelForCausalLM, workers: Workers | None, n: int,
              tokens: int) -> list[dict]:
    if mode == "one_after_another":
        return [generate_one(client, i, tokens) for i in range(n)]
    if mode == "processes":
        return workers.run(tokens)
    results: list = [None] * n
    barrier = threading.Barrier(n)

    def run(i: int) -> None:
        barrier.wait()
        results[i] = generate_one(client, i, tokens)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None for r in results), "a generation failed"
    return results


def run_generate(preset: str, ns: list[int], repeats: int, tokens: int, blocks: int | None,
                 quants: tuple[str, ...], max_processes: int) -> dict:
    model_dir = gen_checkpoint(preset, blocks)
    num_blocks = int(load_config(model_dir).num_hidden_layers)
    rows: dict = {}
    for precision in quants:
        dtype, quant = PRECISIONS[precision]
        with LocalSwarm(model_dir, threads=1, with_dht=False,
                        server_args=["--max-sessions", "64", "--quant", quant, "--dtype", dtype]) as swarm:
            swarm.start([BlockRange(0, num_blocks)])
            client = DistributedModelForCausalLM.from_pretrained(model_dir, servers=swarm.addresses,
                                                                 routing="shortest", quant=quant, dtype=dtype)
            try:
                gen_round("threads", client, None, 2, 2)  # warm up channels, server, head batcher
                for n in ns:
                    modes = ["one_after_another", "threads"] + (["processes"] if n <= max_processes else [])
                    workers = Workers(n, model_dir, swarm.addresses[0], precision) if "processes" in modes else None
                    try:
                        samples = {m: [] for m in modes}
                        server_batches = {m: [] for m in modes}
                        head_batches = {m: [] for m in modes}
                        reference = None
                        for r in range(repeats):
                            for mode in (modes if r % 2 == 0 else modes[::-1]):
                                if client.head_batcher is not None:
                                    client.head_batcher.batch_sizes.clear()
                                res = gen_round(mode, client, workers, n, tokens)
                                wall = max(x["end"] for x in res) - min(x["start"] for x in res)
                                if mode == "one_after_another":
                                    wall = sum(x["end"] - x["start"] for x in res)
                                samples[mode].append(n * tokens / wall)
                                server_batches[mode] += [b for x in res for b in x["server_batches"]]
                                if client.head_batcher is not None and mode != "processes":
                                    head_batches[mode] += [k for k, c in client.head_batcher.batch_sizes.items()
                                                           for _ in range(c)]
                                got = [x["tokens"] for x in res]
                                assert all(len(t) == prompt_len(i) + tokens for i, t in enumerate(got)), \
                                    "a generation stopped early"
                                reference = reference or got
                                assert got == reference, f"{mode}: tokens differ from the other modes'"
                                print(f"  {precision} n={n} {mode} repeat {r}: {samples[mode][-1]:.2f} tok/s "
                                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
                    finally:
                        if workers is not None:
                            workers.close()
                    key = f"{precision} {n}"
                    rows[key] = _summary(samples, "one_after_another")
                    rows[key]["mean_server_batch"] = {m: statistics.mean(b) for m, b in server_batches.items() if b}
                    rows[key]["mean_head_batch"] = {m: statistics.mean(b) for m, b in head_batches.items() if b}
                    rows[key]["tokens_identical"] = True
            finally:
                client.close()
    return rows


def _summary(samples: dict[str, list[float]], base: str) -> dict:
    med = {mode: statistics.median(v) for mode, v in samples.items()}
    # ratios per repeat (modes of one repeat ran back to back), then their median: robust to drifting load
    ratios = {mode: statistics.median(a / b for a, b in zip(v, samples[base])) for mode, v in samples.items()
              if mode != base}
    return {"tokens_per_s": med, "speedup": ratios, "samples": samples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="tiny-bloom,bloomz-560m")
    parser.add_argument("--sessions", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=8, help="decode steps per session per measurement")
    parser.add_argument("--levels", default="stage,swarm")
    parser.add_argument("--no-unbatched", action="store_true",
                        help="swarm level: skip the second server with batching off (saves its memory)")
    parser.add_argument("--stage-blocks", type=int, help="stage level: hold only the first N blocks (less memory)")
    parser.add_argument("--quant", default="none",
                        help="stage and generate levels: weight quantizations side by side, e.g. none,int8; the "
                             "generate level also takes bf16 (servers' and client's dtype bfloat16)")
    parser.add_argument("--gen-blocks", type=int, default=4,
                        help="generate level: a checkpoint of the preset's shapes with this many blocks (0: all)")
    parser.add_argument("--max-processes", type=int, default=8,
                        help="generate level: the separate-processes mode only up to this many sessions (memory)")
    parser.add_argument("--out", default="docs/results/batching.json")
    parser.add_argument("--worker-model", help=argparse.SUPPRESS)  # a client process of the generate level
    parser.add_argument("--worker-server", help=argparse.SUPPRESS)
    parser.add_argument("--worker-quant", default="none", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_model:
        worker_main(args)
        return
    torch.set_num_threads(1)
    ns = [int(x) for x in args.sessions.split(",")]
    results = {"machine": machine_info(), "threads": "1 torch thread per process",
               "load_avg_at_start": os.getloadavg(), "stage_blocks": args.stage_blocks, "repeats": args.repeats, "tokens": args.tokens, "presets": {}}
    for preset in args.presets.split(","):
        model_dir = str(default_checkpoint(preset))
        results["presets"][preset] = {}
        for level in args.levels.split(","):
            if level == "stage":
                rows = run_stage(model_dir, ns, args.repeats, args.tokens, args.stage_blocks,
                                 tuple(args.quant.split(",")))
            elif level == "generate":
                rows = run_generate(preset, ns, args.repeats, args.tokens, args.gen_blocks or None,
                                    tuple(args.quant.split(",")), args.max_processes)
            else:
                rows = run_swarm(model_dir, ns, args.repeats, args.tokens, unbatched=not args.no_unbatched)
            results["presets"][preset][level] = rows
            print(f"\n{preset}, {level} level (tokens/s, median of {args.repeats}; speedup = median per-repeat ratio)")
            modes = list(next(iter(rows.values()))["tokens_per_s"])
            print("| sessions | " + " | ".join(modes) + " | " + " | ".join(f"x {m}" for m in modes[1:]) + " |")
            print("|---" * (2 * len(modes)) + "|")
            for n, row in rows.items():
                cells = [f"{row['tokens_per_s'].get(m, float('nan')):.2f}" for m in modes] + \
                        [f"{row['speedup'].get(m, float('nan')):.2f}" for m in modes[1:]]
                print(f"| {n} | " + " | ".join(cells) + " |", flush=True)
            if level == "generate":
                for n, row in rows.items():
                    print(f"{n}: mean server batch (decode) {row['mean_server_batch']}, "
                          f"mean head batch {row['mean_head_batch']}")
            if level == "swarm":  # how many steps shared a forward, as the server reported it
                print("mean server batch: " + "; ".join(
                    f"{n} sessions " + ", ".join(f"{m} {v:.2f}" for m, v in row["mean_server_batch"].items())
                    for n, row in rows.items()))
    results["load_avg_at_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
