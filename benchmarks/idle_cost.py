"""What a server pays for sleeping between its turns, in one process, no network at all.

In a chain of N servers every server sleeps while the others and the client's LM head compute (~140 ms per
BLOOMZ-560M token at N = 4); one process running all blocks never sleeps. This measures, side by side in rounds:

1. a decode request's parse, checks and decode as SwarmService does them (checks.decode_step) back to back, and
   after 140 ms asleep;
2. the 24 BLOOMZ-560M blocks as four spans of 6 (four Stages, as four servers hold them) stepped one after the other
   with no pause, and with 140 ms asleep before each span (as each server of a chain of 4 waits for its turn).

    .venv/bin/python benchmarks/idle_cost.py [--preset bloomz-560m] [--spans 4] [--sleep-ms 140] [--rounds 4]

Medians of 20 steps per round; one thread.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from swarmlm.machine import machine_line
from swarmlm.model.checkpoint import load_config
from swarmlm.model.random_checkpoint import default_checkpoint
from swarmlm.server.checks import decode_step
from swarmlm.server.stage import Stage
from swarmlm.types import BlockRange
from swarmlm.wire import codec, compress
from swarmlm.wire import swarm_pb2 as pb


def request_checks_s(raw: bytes, hidden_size: int) -> float:
    """Parse one decode request and check and decode its tensors as the server does (StepChecks.shape's
    header check, checks.decode_step): the Python + torch work between a message's arrival and its forward."""
    t0 = time.perf_counter()
    step = pb.InferenceRequest.FromString(raw).step
    codec.header(step.hidden, "hidden", max_elements=1 << 25)
    decode_step(step.hidden, step.attention_mask, 1, 1, hidden_size)
    return time.perf_counter() - t0


def spans_s(stages: list[Stage], states, sleep_s: float) -> float:
    """One decode token through every span in turn; the compute time only (sleeps excluded)."""
    x, one, total = torch.randn(1, 1, stages[0].hidden_size), torch.ones(1, 1, dtype=torch.long), 0.0
    for stage, state in zip(stages, states):
        if sleep_s:
            time.sleep(sleep_s)
        t0 = time.perf_counter()
        x = stage.step(state, x, one)
        total += time.perf_counter() - t0
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bloomz-560m")
    ap.add_argument("--spans", type=int, default=4)
    ap.add_argument("--sleep-ms", type=float, default=140.0)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    print("machine:", machine_line(), flush=True)  # where the figures below come from
    torch.set_num_threads(1)
    model_dir = str(default_checkpoint(args.preset))
    n = int(load_config(model_dir).num_hidden_layers)
    bounds = [round(n * k / args.spans) for k in range(args.spans + 1)]
    stages = [Stage(model_dir, BlockRange(a, b)) for a, b in zip(bounds, bounds[1:])]
    h = stages[0].hidden_size
    raw = pb.InferenceRequest(step=pb.InferenceStep(
        hidden=compress.encode_hidden(torch.randn(1, 1, h), "float32"), step_id=1,
        attention_mask=codec.encode(torch.ones(1, 1, dtype=torch.long)))).SerializeToString()
    sleep_s = args.sleep_ms / 1000
    rows: dict[str, list[float]] = {"request checks, back to back": [], "request checks, after sleeping": [],
                                    "all spans, back to back": [], "all spans, sleeping before each": []}
    for r in range(args.rounds):
        max_length = 2 * args.steps + 16
        for pause in ((0.0, sleep_s) if r % 2 == 0 else (sleep_s, 0.0)):  # alternating: noise hits both
            kind = "back to back" if pause == 0 else "after sleeping"
            checks = []
            for _ in range(args.steps):
                time.sleep(pause)
                checks.append(request_checks_s(raw, h))
            rows[f"request checks, {kind}"].append(statistics.median(checks) * 1e3)
            states = [s.new_state(s.blocks, 1, max_length) for s in stages]
            for s, state in zip(stages, states):
                s.step(state, torch.randn(1, 16, h), torch.ones(1, 16, dtype=torch.long))
            kind = "back to back" if pause == 0 else "sleeping before each"
            rows[f"all spans, {kind}"].append(
                statistics.median(spans_s(stages, states, pause) for _ in range(args.steps)) * 1e3)
    print(f"{args.preset}: {args.spans} spans of {bounds[1] - bounds[0]} blocks, {args.sleep_ms:.0f} ms asleep, "
          f"medians of {args.steps} steps, {args.rounds} alternating rounds")
    print("| part | ms (median of rounds) | rounds |")
    print("|---|---|---|")
    for name, values in rows.items():
        print(f"| {name} | {statistics.median(values):.3f} | {' / '.join(f'{v:.3f}' for v in values)} |")
    for what in ("request checks", "all spans"):
        a = [v for k, v in rows.items() if k.startswith(what)]
        print(f"{what}: sleeping / back to back = {statistics.median(a[1]) / statistics.median(a[0]):.2f}x")


if __name__ == "__main__":
    main()
