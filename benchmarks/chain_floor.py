"""The floor under a split decode token on this machine: bare C processes (benchmarks/chain_floor.c, compiled here
with `cc -O2` into a temporary directory) doing what a token through 1 or N servers does, with the compute made of
memory streams (each process its own 256 MiB buffer: every turn starts on caches another process filled) and the
messages over loopback TCP: the client's own part (--head-ms: embeddings, LM head), then the servers' blocks
(--compute-ms in all, split evenly), relayed (the client sends to each server in turn) or pushed (each server sends
on to the next; with middle replies, as swarmlm's pushes send each middle output back for failover, or without, as
llama.cpp's RPC chain needs none). What ratio 3 servers / 1 any implementation could reach here, with no parse,
no check and no interpreter: the ceiling for issue 40's ">= 0.95x".

    python benchmarks/chain_floor.py [--compute-ms 2.73] [--head-ms 0.88] [--servers 3] [--tokens 100] [--rounds 3]

Defaults: SmolLM2-135M Q4_1's servers' compute per token (2.73 ms) and the client's part of a token (~0.88 ms: a
1-server token's "rest" minus its hop) from `split_decode.py` on this machine (docs/RESULTS-hop.md round 17). Each
setting runs --rounds times in alternating order, a fresh set of processes each time; medians over all tokens.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

from swarmlm.machine import machine_line

SOURCE = Path(__file__).with_name("chain_floor.c")
HIDDEN_BYTES = 576 * 4  # SmolLM2's hidden state, float32


def settings(servers: int) -> dict[str, tuple[int, int, int]]:
    """name -> (servers, push, middle replies)"""
    return {"1 server": (1, 0, 0), f"{servers} relayed": (servers, 0, 0),
            f"{servers} pushed + middle replies": (servers, 1, 1), f"{servers} pushed": (servers, 1, 0)}


def run(binary: Path, setting: tuple[int, int, int], args) -> list[float]:
    n, push, middle = setting
    done = subprocess.run([str(binary), str(n), str(args.tokens), "5", str(args.compute_ms), str(args.head_ms),
                           str(push), str(middle), str(HIDDEN_BYTES)], capture_output=True, text=True, timeout=300,
                          check=True)
    return [int(line) / 1e6 for line in done.stdout.split()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compute-ms", type=float, default=2.73)
    ap.add_argument("--head-ms", type=float, default=0.88)
    ap.add_argument("--servers", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("no C compiler (cc / gcc)")
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "chain_floor"
        subprocess.run([cc, "-O2", "-o", str(binary), str(SOURCE)], check=True)
        chosen = settings(args.servers)
        times: dict[str, list[float]] = {name: [] for name in chosen}
        for r in range(args.rounds):
            for name in (list(chosen) if r % 2 == 0 else list(chosen)[::-1]):
                times[name].extend(run(binary, chosen[name], args))
    print(f"{machine_line()}; compute {args.compute_ms} ms per token over the servers, client {args.head_ms} ms, "
          f"{HIDDEN_BYTES} bytes per message; medians of {args.rounds} x {args.tokens} tokens\n")
    one = statistics.median(times["1 server"])
    print("| setting | ms per token | p90 | speed vs 1 server |\n|---|---|---|---|")
    for name, values in times.items():
        median = statistics.median(values)
        p90 = statistics.quantiles(values, n=10)[-1]
        print(f"| {name} | {median:.3f} | {p90:.3f} | {one / median:.3f}x |")


if __name__ == "__main__":
    main()
