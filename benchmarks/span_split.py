"""What splitting a model's blocks into N spans costs its compute alone, in one process: no hop, no sleep, no other
process evicting the caches (issue 40: the part of `split_decode.py`'s 3-server slowdown no hop can remove).

    python benchmarks/split_decode.py ...   # through real servers: compute + hops
    python benchmarks/span_split.py [--model FILE.gguf] [--spans 3] [--rounds 5] [--tokens 64]

One Stage holding every block and N Stages holding an even split (as N servers would, packed weights, --quant auto),
each with a session of one row after an 8-token prompt; a decode step of one token through the one, then through
the N one after the other, alternating, one torch thread. Per token: the thread's CPU time (medians per round, then
the median over rounds). The difference is what N - 1 extra span calls cost (each call's own setup, the kernel's
per-call work) even when the spans share one process and never wait.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from swarmlm.machine import machine_line
from swarmlm.model.checkpoint import load_config
from swarmlm.server.stage import Stage
from swarmlm.swarm.local import even_split
from swarmlm.types import BlockRange
from split_decode import DEFAULT_MODEL

PROMPT_TOKENS = 8


def span_split_ms(model: str, spans: int, rounds: int, tokens: int) -> dict[str, float]:
    blocks = int(load_config(model).num_hidden_layers)
    setups = {"1 span": [Stage(model, BlockRange(0, blocks))],
              f"{spans} spans": [Stage(model, r) for r in even_split(blocks, spans)]}
    hidden_size = setups["1 span"][0].hidden_size
    states = {name: [stage.new_state(stage.blocks, 1, PROMPT_TOKENS + rounds * tokens + 1) for stage in stages]
              for name, stages in setups.items()}

    def through(name: str, hidden: torch.Tensor) -> torch.Tensor:
        for stage, state in zip(setups[name], states[name]):
            hidden = stage.step(state, hidden, torch.ones(1, hidden.shape[1], dtype=torch.long))
        return hidden

    for name in setups:
        through(name, torch.randn(1, PROMPT_TOKENS, hidden_size))
    token = torch.randn(1, 1, hidden_size)
    per_round: dict[str, list[float]] = {name: [] for name in setups}
    for r in range(rounds):
        times: dict[str, list[float]] = {name: [] for name in setups}
        for _ in range(tokens):
            for name in (list(setups) if r % 2 == 0 else list(setups)[::-1]):
                started = time.thread_time()
                through(name, token)
                times[name].append(time.thread_time() - started)
        for name, values in times.items():
            per_round[name].append(statistics.median(values) * 1000)
    return {name: statistics.median(values) for name, values in per_round.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="a GGUF file (or a checkpoint directory)")
    ap.add_argument("--spans", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("machine:", machine_line(), flush=True)
    print("load average at start: %.2f %.2f %.2f" % os.getloadavg(), flush=True)
    ms = span_split_ms(args.model, args.spans, args.rounds, args.tokens)
    print("load average at end: %.2f %.2f %.2f" % os.getloadavg())
    one, split = ms["1 span"], ms[f"{args.spans} spans"]
    print(f"per token, thread CPU: 1 span {one:.3f} ms, {args.spans} spans {split:.3f} ms: +{split - one:.3f} ms "
          f"({(split - one) / max(args.spans - 1, 1):.3f} ms per extra span call); {args.spans} / 1 speed "
          f"{one / split:.3f}x with no hop at all")


if __name__ == "__main__":
    main()
