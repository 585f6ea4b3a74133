"""What splitting a model's blocks into N spans costs its compute alone, in one process: no hop, no sleep, no other
process evicting the caches (issue 40: the part of `split_decode.py`'s 3-server slowdown no hop can remove).

    python benchmarks/split_decode.py ...   # through real servers: compute + hops
    python benchmarks/span_split.py [--model FILE.gguf] [--spans 3] [--rounds 5] [--tokens 64] [--cold]
                                    [--count]

One Stage holding every block and N Stages holding an even split (as N servers would, packed weights, --quant auto),
each with a session of one row after an 8-token prompt; a decode step of one token through the one, then through
the N one after the other, alternating, one torch thread. Per token: the thread's CPU time of the span calls (each
`Stage.step` timed, summed; medians per round, then the median over rounds). The difference is what N - 1 extra span
calls cost (each call's own setup, the kernel's per-call work) even when the spans share one process and never wait.

--cold: a 64 MiB sweep (untimed) before every span call, as every server's step starts in a swarm (its caches
evicted by the other processes while it waited). --count: the Python calls (sys.setprofile's calls into Python and C
functions) and the torch operations (ATen ops dispatched) of one span's decode step.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from swarmlm.machine import machine_line
from swarmlm.model.checkpoint import load_config
from swarmlm.server.stage import Stage
from swarmlm.swarm.local import even_split
from swarmlm.types import BlockRange
from split_decode import DEFAULT_MODEL

PROMPT_TOKENS = 8
SWEEP_BYTES = 64 << 20  # twice this machine's L3: what a step finds after other processes ran


def span_split_ms(model: str, spans: int, rounds: int, tokens: int, cold: bool = False) -> dict[str, float]:
    blocks = int(load_config(model).num_hidden_layers)
    setups = {"1 span": [Stage(model, BlockRange(0, blocks))],
              f"{spans} spans": [Stage(model, r) for r in even_split(blocks, spans)]}
    hidden_size = setups["1 span"][0].hidden_size
    states = {name: [stage.new_state(stage.blocks, 1, PROMPT_TOKENS + rounds * tokens + 1) for stage in stages]
              for name, stages in setups.items()}

    sweep = np.ones(SWEEP_BYTES // 8) if cold else None
    one = torch.ones(1, 1, dtype=torch.long)

    def through(name: str, hidden: torch.Tensor) -> float:
        """Thread CPU seconds of the span calls (the sweeps not counted)."""
        spent = 0.0
        for stage, state in zip(setups[name], states[name]):
            if sweep is not None:
                sweep.sum()
            started = time.thread_time()
            hidden = stage.step(state, hidden, one)
            spent += time.thread_time() - started
        return spent

    for name, stages in setups.items():
        hidden = torch.randn(1, PROMPT_TOKENS, hidden_size)
        for stage, state in zip(stages, states[name]):
            hidden = stage.step(state, hidden, torch.ones(1, PROMPT_TOKENS, dtype=torch.long))
    token = torch.randn(1, 1, hidden_size)
    per_round: dict[str, list[float]] = {name: [] for name in setups}
    for r in range(rounds):
        times: dict[str, list[float]] = {name: [] for name in setups}
        for _ in range(tokens):
            for name in (list(setups) if r % 2 == 0 else list(setups)[::-1]):
                times[name].append(through(name, token))
        for name, values in times.items():
            per_round[name].append(statistics.median(values) * 1000)
    return {name: statistics.median(values) for name, values in per_round.items()}


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def calls_and_ops(model: str, blocks: int) -> tuple[int, int]:
    """(Python calls, ATen ops) of one decode step of one row through a span of `blocks` blocks, warm."""
    stage = Stage(model, BlockRange(0, blocks))
    state = stage.new_state(stage.blocks, 1, PROMPT_TOKENS + 8)
    stage.step(state, torch.randn(1, PROMPT_TOKENS, stage.hidden_size), torch.ones(1, PROMPT_TOKENS, dtype=torch.long))
    token, one = torch.randn(1, 1, stage.hidden_size), torch.ones(1, 1, dtype=torch.long)
    for _ in range(3):
        stage.step(state, token, one)
    calls = 0

    def count(frame, event, arg) -> None:
        nonlocal calls
        calls += event in ("call", "c_call")

    sys.setprofile(count)
    stage.step(state, token, one)
    sys.setprofile(None)
    with _CountOps() as counted:
        stage.step(state, token, one)
    return calls - 1, counted.ops  # (not setprofile's own call)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="a GGUF file (or a checkpoint directory)")
    ap.add_argument("--spans", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--cold", action="store_true", help="a 64 MiB sweep before every span call (not timed)")
    ap.add_argument("--count", action="store_true", help="also count one span call's Python calls and torch ops")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("machine:", machine_line(), flush=True)
    print("load average at start: %.2f %.2f %.2f" % os.getloadavg(), flush=True)
    if args.count:
        blocks = int(load_config(args.model).num_hidden_layers) // args.spans
        calls, ops = calls_and_ops(args.model, blocks)
        print(f"one span call ({blocks} blocks, one row, one new token): {calls} Python calls, {ops} torch ops")
    ms = span_split_ms(args.model, args.spans, args.rounds, args.tokens, args.cold)
    print("load average at end: %.2f %.2f %.2f" % os.getloadavg())
    one, split = ms["1 span"], ms[f"{args.spans} spans"]
    print(f"per token, thread CPU{' (cold)' if args.cold else ''}: 1 span {one:.3f} ms, {args.spans} spans "
          f"{split:.3f} ms: +{split - one:.3f} ms "
          f"({(split - one) / max(args.spans - 1, 1):.3f} ms per extra span call); {args.spans} / 1 speed "
          f"{one / split:.3f}x with no hop at all")


if __name__ == "__main__":
    main()
