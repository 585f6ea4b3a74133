"""A benchmark run on asyncio's event loop and on uvloop's, alternating (swarmlm/event_loop.py, docs/RESULTS-hop.md
Round 14): each run a subprocess whose SWARMLM_EVENT_LOOP reaches its client and every server it starts.

    python benchmarks/loop_ab.py [--runs 2] -- benchmarks/hop_breakdown.py --transports --rounds 4 --servers 1

Runs alternate asyncio, uvloop, uvloop, asyncio, ... (machine noise hits both alike). Every output line with decimal
numbers in it is printed once per loop with each number the median over that loop's runs (lines matched by their
text with the decimals taken out), after each run's own output and the load average before and after it."""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

LOOPS = ("asyncio", "uvloop")
DECIMAL = re.compile(r"-?\d+\.\d+")


def run_once(command: list[str], loop: str) -> str:
    env = dict(os.environ, SWARMLM_EVENT_LOOP=loop)
    before = os.getloadavg()
    out = subprocess.run([sys.executable, *command], env=env, check=True, capture_output=True, text=True).stdout
    print(f"---- {loop}: load {before[0]:.2f} -> {os.getloadavg()[0]:.2f}\n{out}", flush=True)
    return out


def medians(outputs: list[str]) -> list[str]:
    """Each line shape (text without its decimals) of the first output, its numbers the medians over `outputs`."""
    numbers: dict[str, list[list[float]]] = {}
    shapes: dict[str, str] = {}  # (spaces collapsed: a wider number moves the padding) -> the first line's shape
    for out in outputs:
        for line in out.splitlines():
            if DECIMAL.search(line):
                shape = DECIMAL.sub("{}", line.replace("{", "{{").replace("}", "}}"))
                key = " ".join(shape.split())
                shapes.setdefault(key, shape)
                numbers.setdefault(key, []).append([float(x) for x in DECIMAL.findall(line)])
    return [shapes[key].format(*(f"{statistics.median(col):.3f}" for col in zip(*rows)))
            for key, rows in numbers.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=2, help="runs per loop")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- a benchmark script and its arguments")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("no benchmark given (after --)")
    outputs: dict[str, list[str]] = {loop: [] for loop in LOOPS}
    for r in range(args.runs):
        for loop in (LOOPS if r % 2 == 0 else LOOPS[::-1]):
            outputs[loop].append(run_once(command, loop))
    for loop in LOOPS:
        print(f"==== {loop}: medians of {args.runs} runs")
        print("\n".join(medians(outputs[loop])), flush=True)


if __name__ == "__main__":
    main()
