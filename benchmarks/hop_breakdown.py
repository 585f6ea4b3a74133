"""Where a decode step's time goes through N tiny-bloom servers on loopback (medians of 400 steps, no LM head):

    the caller's session.step = server compute + server queue + server parse/serialise + wire and gRPC
                                + client serialise/parse + the client's own work (between hops, hand-off to its loop)

Usage: .venv/bin/python benchmarks/hop_breakdown.py [--servers N] [--preset tiny-bloom] [--ab ROUNDS]

--ab: the client's one-message fast path against the task pipeline every step used before, rounds alternating in
one run (medians, and the median of per-round ratios).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.client.session import InferenceSession
from swarmlm.model.checkpoint import load_config
from swarmlm.model.init import default_checkpoint
from swarmlm.swarm.local import LocalSwarm, even_split

PROMPT = list(range(10, 26))


def breakdown(client: DistributedModelForCausalLM, sessions: int = 4, steps: int = 100) -> dict[str, float]:
    """Median milliseconds per decode step, per part."""
    rows: list[dict[str, float]] = []
    for _ in range(sessions):
        with client.inference_session(max_length=len(PROMPT) + steps + 1) as session:
            client.step_logits(session, torch.tensor([PROMPT]))
            x = client.embed(torch.tensor([[5]]))
            for _ in range(steps):
                t0 = time.perf_counter()
                session.step(x)
                call = time.perf_counter() - t0
                rec = session.steps[-1]
                hops = rec.hops
                wall, queued = sum(h.wall_s for h in hops), sum(h.queued_s for h in hops)
                compute, sio = sum(h.compute_s for h in hops), sum(h.server_io_s for h in hops)
                cio = sum(h.client_io_s for h in hops)
                rows.append({
                    "the caller's session.step": call,
                    "server compute (all hops)": compute,
                    "wire + gRPC": wall - queued - compute - sio,
                    "server parse/validate + serialise": sio,
                    "server queue": queued,
                    "client serialise + parse": cio,
                    "client: between hops + hand-off": (rec.wall_s - wall - cio) + (call - rec.wall_s),
                })
    return {k: statistics.median(r[k] for r in rows) * 1000 for k in rows[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--preset", default="tiny-bloom")
    ap.add_argument("--ab", type=int, default=0, metavar="ROUNDS", help="fast path vs pipeline, alternating")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = str(default_checkpoint(args.preset))
    with LocalSwarm(model_dir, threads=1, with_dht=False) as swarm:
        swarm.start(even_split(int(load_config(model_dir).num_hidden_layers), args.servers))
        client = DistributedModelForCausalLM.from_pretrained(model_dir, servers=swarm.addresses)
        if not args.ab:
            for part, ms in breakdown(client).items():
                print(f"{part:36s} {ms:7.3f} ms")
            return
        breakdown(client, 1, 20)  # warm-up
        runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
        for r in range(args.ab):
            for fast in (True, False) if r % 2 == 0 else (False, True):
                InferenceSession.one_message_fast_path = fast
                runs[fast].append(breakdown(client, 1, 100))
        InferenceSession.one_message_fast_path = True
        for part in runs[True][0]:
            f, p = (statistics.median(run[part] for run in runs[m]) for m in (True, False))
            print(f"{part:36s} fast path {f:7.3f} ms   pipeline {p:7.3f} ms")
        key = "the caller's session.step"
        ratio = statistics.median(a[key] / b[key] for a, b in zip(runs[True], runs[False]))
        print(f"per-round ratio of the step, fast path / pipeline: {ratio:.3f}")


if __name__ == "__main__":
    main()
