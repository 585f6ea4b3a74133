"""Where a decode step's wall time goes between threads, gRPC vs framed (rounds alternating, one tiny-bloom server on
loopback): per step, each busy thread's time on a CPU, its time waiting in the run queue (runnable, no CPU: Linux
/proc/<pid>/task/<tid>/schedstat) and its voluntary / involuntary context switches (status). On a loaded machine
the step's time is mostly run-queue waits; this shows whose (docs/RESULTS-hop.md, "Under load").

Usage: .venv/bin/python benchmarks/hop_threads.py [--rounds 4] [--steps 200] [--pin]
--pin: the server's threads on CPU 0, the client's on CPU 1 (a diagnosis: do client and server share a CPU?).
"""
from __future__ import annotations

import argparse
import glob
import os
import statistics
import time

import torch

from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.machine import machine_line
from swarmlm.model.checkpoint import load_config
from swarmlm.model.random_checkpoint import default_checkpoint
from swarmlm.swarm.local import LocalSwarm, even_split

PROMPT = list(range(10, 26))


def threads(pid: int) -> dict[str, tuple[str, int, int, int, int]]:
    """tid -> (name, ns on CPU, ns in the run queue, voluntary switches, involuntary switches)."""
    out = {}
    for task in glob.glob(f"/proc/{pid}/task/*"):
        try:
            name = open(f"{task}/comm").read().strip()
            on_cpu, waited, _ = (int(v) for v in open(f"{task}/schedstat").read().split())
            status = dict(line.split(":\t") for line in open(f"{task}/status").read().splitlines() if "ctxt" in line)
        except (FileNotFoundError, ProcessLookupError):
            continue
        out[task.rsplit("/", 1)[1]] = (name, on_cpu, waited, int(status["voluntary_ctxt_switches"]),
                                       int(status["nonvoluntary_ctxt_switches"]))
    return out


def per_step(before: dict, after: dict, steps: int) -> dict[str, tuple[float, float, float, float]]:
    """Threads that ran at least every other step: (us on CPU, us in the run queue, voluntary, involuntary)."""
    rows = {}
    for tid, now in after.items():
        if tid in before:
            d = [now[i] - before[tid][i] for i in range(1, 5)]
            if d[2] + d[3] >= steps // 2:
                rows[f"{now[0]}/{tid}"] = (d[0] / steps / 1e3, d[1] / steps / 1e3, d[2] / steps, d[3] / steps)
    return rows


def pin(pid: int, cpu: int) -> None:
    for task in glob.glob(f"/proc/{pid}/task/*"):
        os.sched_setaffinity(int(task.rsplit("/", 1)[1]), {cpu})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--pin", action="store_true")
    args = ap.parse_args()
    print("machine:", machine_line(), flush=True)
    torch.set_num_threads(1)
    model_dir = str(default_checkpoint("tiny-bloom"))
    with LocalSwarm(model_dir, threads=1, with_dht=False) as swarm:
        swarm.start(even_split(int(load_config(model_dir).num_hidden_layers), 1))
        server = swarm.servers[0].proc.pid
        clients = {name: DistributedModelForCausalLM.from_pretrained(model_dir, servers=swarm.addresses, push=False,
                                                                     frames=name == "framed")
                   for name in ("gRPC", "framed")}
        if args.pin:
            pin(server, 0)
            pin(os.getpid(), 1)
        runs: dict[str, list] = {name: [] for name in clients}
        print("load average at start: %.1f %.1f %.1f" % os.getloadavg())
        for r in range(args.rounds):
            for name in (list(clients) if r % 2 == 0 else list(clients)[::-1]):
                client = clients[name]
                with client.inference_session(max_length=len(PROMPT) + args.steps + 20) as session:
                    client.step_logits(session, torch.tensor([PROMPT]))
                    x = client.embed(torch.tensor([[5]]))
                    for _ in range(10):
                        session.step(x)
                    s0, c0, t0 = threads(server), threads(os.getpid()), time.perf_counter()
                    for _ in range(args.steps):
                        session.step(x)
                    wall_ms = (time.perf_counter() - t0) / args.steps * 1e3
                    runs[name].append((wall_ms, per_step(s0, threads(server), args.steps),
                                       per_step(c0, threads(os.getpid()), args.steps)))
        print("load average at end: %.1f %.1f %.1f" % os.getloadavg())
        for name, rows in runs.items():
            print(f"{name}: step (mean per round) " + " ".join(f"{r[0]:.2f}" for r in rows) + " ms")
            for side, k in (("server", 1), ("client", 2)):
                for thread in sorted(set().union(*(r[k] for r in rows))):
                    vals = [r[k][thread] for r in rows if thread in r[k]]
                    on, wait, vol, invol = (statistics.median(v[i] for v in vals) for i in range(4))
                    print(f"  {side} {thread:26s} per step: on CPU {on:7.1f} us, run queue {wait:8.1f} us, "
                          f"switches voluntary {vol:.2f} involuntary {invol:.2f}")


if __name__ == "__main__":
    main()
