"""What a cache operation costs on a server (issue 29): one decode step with and without its op, in one process.

BLOOMZ-560M shapes (random weights), a span of `--blocks` blocks (a server's share), a session prefilled with a
`--context`-token prompt in 4 rows (beams). Per round, in turn: a plain 4-row decode step; the same step with a
reorder of the 4 beams (CacheOp rows: the cache's rows gathered into new buffers); a 1-row decode step plain and
with a truncate (CacheOp truncate_to: the last token rolled back, so the session keeps its length); and the ops
alone (`SpanState.edited`, nothing computed). Medians over rounds of `--steps` steps each; ratios to the plain step.

    .venv/bin/python benchmarks/cacheops_bench.py [--blocks 4] [--context 128 512] [--rounds 5] [--steps 10]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from swarmlm.model.random_checkpoint import init_checkpoint  # noqa: E402
from swarmlm.server.stage import SpanState, Stage  # noqa: E402
from swarmlm.types import BlockRange, CacheOp  # noqa: E402

BEAMS = 4


def checkpoint(blocks: int) -> str:
    path = Path.home() / ".cache" / "swarmlm" / "checkpoints" / f"bloomz-560m-{blocks}blocks-seed0"
    if not (path / "swarmlm.json").is_file():
        init_checkpoint("bloomz-560m", path, num_layers=blocks)
    return str(path)


def prefilled(stage: Stage, rows: int, context: int) -> SpanState:
    state = stage.new_state(stage.blocks, rows, context + 1024)
    stage.step(state, torch.randn(rows, context, stage.hidden_size), torch.ones(rows, context, dtype=torch.long))
    return state


def timed(fn, steps: int) -> float:
    """Median seconds of `steps` calls."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(stage: Stage, context: int, rounds: int, steps: int) -> dict[str, float]:
    beams, lone = prefilled(stage, BEAMS, context), prefilled(stage, 1, context)
    x4, x1 = torch.randn(BEAMS, 1, stage.hidden_size), torch.randn(1, 1, stage.hidden_size)
    m4, m1 = torch.ones(BEAMS, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long)
    reorder = CacheOp(rows=(1, 0, 0, 2))  # beam search's usual: one beam dropped, one copied

    def back(state: SpanState) -> CacheOp:
        return CacheOp(truncate_to=state.position - 1)

    variants = {
        "4 beams: plain step": lambda: stage.step(beams, x4, m4),
        "4 beams: step + reorder": lambda: stage.step(beams, x4, m4, reorder),
        "4 beams: reorder alone": lambda: beams.edited(reorder, BEAMS),
        "1 row: plain step": lambda: stage.step(lone, x1, m1),
        "1 row: step + truncate": lambda: stage.step(lone, x1, m1, back(lone)),
        "1 row: truncate alone": lambda: lone.edited(back(lone), 1),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    with torch.inference_mode():
        for _ in range(rounds):  # interleaved: machine noise hits every variant alike
            for name, fn in variants.items():
                samples[name].append(timed(fn, steps))
    return {name: statistics.median(v) for name, v in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--context", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    stage = Stage(checkpoint(args.blocks), BlockRange(0, args.blocks))
    print(f"# bloomz-560m shapes, {args.blocks} blocks, fp32, {args.threads} thread(s), {platform.processor() or ''} "
          f"torch {torch.__version__}; medians of {args.rounds} rounds x {args.steps} steps")
    print("| context | what | ms | x plain step (same rows) |")
    print("|---|---|---|---|")
    for context in args.context:
        result = run(stage, context, args.rounds, args.steps)
        for name, s in result.items():
            base = result["4 beams: plain step" if name.startswith("4") else "1 row: plain step"]
            print(f"| {context} | {name} | {s * 1e3:.2f} | {s / base:.2f} |", flush=True)


if __name__ == "__main__":
    main()
