"""The caller's CPU per relayed decode step with its hops in one C call (client/relay.py) and in Python
(ClientConfig.relay_in_c), rounds alternating, and the Python / C calls each makes in the caller's thread
(docs/RESULTS-hop.md round 19). In-process tiny-bloom servers (tests/swarm_helpers.py), one torch thread: the CPU
time of the caller's thread barely moves with the machine's load, unlike a step's wall time.

    PYTHONPATH=. .venv/bin/python benchmarks/relay_cpu.py [--servers 3] [--rounds 6] [--steps 200]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import Counter

import torch

from swarmlm.model.random_checkpoint import init_checkpoint
from swarmlm.types import BlockRange
from tests.swarm_helpers import client_of, in_process_swarm


def calls_per_step(session, x: torch.Tensor, steps: int = 100) -> Counter:
    counts: Counter = Counter()

    def count(frame, event, arg):
        if event in ("call", "c_call"):
            counts[event] += 1

    sys.setprofile(count)
    try:
        for _ in range(steps):
            session.step(x)
    finally:
        sys.setprofile(None)
    return Counter({k: v / steps for k, v in counts.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = str(init_checkpoint("tiny-bloom", tempfile.mkdtemp(), seed=0))
    n = args.servers
    with in_process_swarm(model, [BlockRange(i * 6 // n, (i + 1) * 6 // n) for i in range(n)]) as swarm:
        clients = {in_c: client_of(swarm, frames=True, push=False, relay_in_c=in_c) for in_c in (True, False)}
        cpu: dict[bool, list[float]] = {k: [] for k in clients}
        calls: dict[bool, Counter] = {}
        print("load average at start: %.2f %.2f %.2f" % os.getloadavg(), flush=True)
        for r in range(args.rounds + 1):
            for in_c in (True, False) if r % 2 == 0 else (False, True):
                client = clients[in_c]
                with torch.no_grad(), client.inference_session(max_length=args.steps + 120) as session:
                    hidden = client.config.hidden_size
                    session.step(torch.randn(1, 3, hidden))
                    x, times = torch.randn(1, 1, hidden), []
                    for _ in range(args.steps):
                        c0 = time.thread_time()
                        session.step(x)
                        times.append(time.thread_time() - c0)
                    if r == 0:  # (the first round warms up; it counts the calls)
                        calls[in_c] = calls_per_step(session, x, 100)
                    else:
                        cpu[in_c].append(statistics.median(times))
        print("load average at end: %.2f %.2f %.2f" % os.getloadavg())
        for in_c, values in cpu.items():
            print(f"hops in {'C' if in_c else 'Python'}: caller's CPU per step {statistics.median(values) * 1e6:.0f} us "
                  f"(rounds: {[round(v * 1e6) for v in values]}); per step {calls[in_c]['call']:.0f} Python calls, "
                  f"{calls[in_c]['c_call']:.0f} C calls")
        for client in clients.values():
            client.close()


if __name__ == "__main__":
    main()
