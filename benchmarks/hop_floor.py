"""The floor under a decode hop on this machine: a bare C client and server (benchmarks/hop_floor.c, compiled here
with `cc -O2` into a temporary directory) exchanging one hop's message over loopback TCP, per round trip minus the
server's compute (issue 40, docs/RESULTS-hop.md round 14). What our framed hop costs above this is our code; this
much any process pair on this VM pays.

    python benchmarks/hop_floor.py [--values 1024] [--compute none sleep:60 stream:60 stream:17 stream:2]
                                   [--rounds 3] [--round-trips 40] [--client-evict]

--values: float32 values per message (1024: bloomz-560m's hidden size, 4 KB; 64: tiny-bloom's). --compute, what
the server does between reading a request and replying, each of: `none` (back to back), `sleep:MS` (asleep, as a
server waiting for its turn), `stream:MS` (reading a 256 MiB buffer for MS ms, as a forward streams its weights
and evicts every cache level). Each setting runs --rounds times, the order reversed every other round, a fresh
process pair each time (--round-trips measured after 5 warm-up ones); the table: median and p90 over all of a
setting's round trips, in microseconds.

--client-evict: also every setting with MS > 0 with the server pinned to CPU 0, the client to CPU 1, and a third
process on CPU 1 streaming memory for 0.8 MS of each server turn while the client sleeps in recv (so the client
wakes with its core's caches full of another process's data, as a swarm's client does beside other servers), next
to the same pinning without that third process.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("hop_floor.c")
MODES = {"none": 0, "sleep": 1, "stream": 2}  # as hop_floor.c numbers them
WARMUP = 5


@dataclass(frozen=True)
class Setting:
    mode: str  # a key of MODES
    compute_ms: float  # the server's sleep or stream per turn (0 for none)
    pinned: bool = False  # server on CPU 0, client on CPU 1
    client_evict: bool = False  # a third process streams on the client's CPU while it waits (needs pinned)

    def __str__(self) -> str:
        what = self.mode if self.mode == "none" else f"{self.mode} {self.compute_ms:g} ms"
        return what + (", pinned, client evicted" if self.client_evict else ", pinned" if self.pinned else "")


def parse_compute(spec: str) -> Setting:
    """`none`, `sleep:MS` or `stream:MS` -> a Setting (ValueError naming the spec otherwise)."""
    mode, _, ms = spec.partition(":")
    if mode not in MODES or (mode == "none") != (ms == ""):
        raise ValueError(f"--compute {spec!r}: expected none, sleep:MS or stream:MS")
    compute_ms = float(ms) if ms else 0.0
    if not 0 <= compute_ms <= 10_000:
        raise ValueError(f"--compute {spec!r}: MS must be within [0, 10000]")
    return Setting(mode, compute_ms)


def compile_floor(into: Path) -> Path:
    if shutil.which("cc") is None:
        raise RuntimeError("no C compiler (`cc`) on PATH: hop_floor.c cannot be built")
    binary = into / "hop_floor"
    subprocess.run(["cc", "-O2", "-o", str(binary), str(SOURCE)], check=True)
    return binary


def run_once(binary: Path, setting: Setting, message_bytes: int, round_trips: int) -> list[int]:
    """Round trip minus server compute, ns, for each measured round trip of one fresh process pair."""
    out = subprocess.run([str(binary), str(message_bytes), str(round_trips), str(WARMUP), str(MODES[setting.mode]),
                          str(setting.compute_ms), str(int(setting.pinned)), str(int(setting.client_evict))],
                         check=True, capture_output=True, text=True).stdout
    overheads = [int(line.split()[0]) for line in out.splitlines()]
    if len(overheads) != round_trips:
        raise RuntimeError(f"{setting}: {len(overheads)} round trips reported, {round_trips} asked")
    return overheads


def measure(binary: Path, settings: list[Setting], message_bytes: int, rounds: int,
            round_trips: int) -> dict[Setting, list[int]]:
    samples: dict[Setting, list[int]] = {s: [] for s in settings}
    for r in range(rounds):  # alternating order: the machine's other load hits every setting alike
        for setting in (settings if r % 2 == 0 else settings[::-1]):
            samples[setting] += run_once(binary, setting, message_bytes, round_trips)
    return samples


def p90(values: list[int]) -> float:
    return statistics.quantiles(values, n=10)[-1]


def with_eviction(settings: list[Setting]) -> list[Setting]:
    """Each setting that waits (MS > 0), pinned without and with the client's caches evicted, after the unpinned."""
    waits = [s for s in settings if s.compute_ms > 0]
    return settings + [Setting(s.mode, s.compute_ms, pinned=True, client_evict=e) for s in waits for e in (False, True)]


def main() -> None:
    from swarmlm.machine import machine_line

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--values", type=int, default=1024, help="float32 values per message (1024: 4 KB; tiny-bloom: 64)")
    ap.add_argument("--compute", nargs="+", default=["none", "sleep:60", "stream:60", "stream:17", "stream:2"],
                    help="none | sleep:MS | stream:MS, one setting each")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--round-trips", type=int, default=40, help="measured per process pair and round")
    ap.add_argument("--client-evict", action="store_true",
                    help="also: pinned, and a third process evicting the client's caches while it waits")
    args = ap.parse_args()
    if args.values < 1 or args.rounds < 1 or args.round_trips < 2:
        ap.error("--values >= 1, --rounds >= 1, --round-trips >= 2")
    try:
        settings = [parse_compute(spec) for spec in args.compute]
    except ValueError as e:
        ap.error(str(e))
    if args.client_evict:
        settings = with_eviction(settings)
    print("machine:", machine_line(), flush=True)
    print(f"message: {args.values} float32 = {4 * args.values} bytes each way (+ 8 bytes of compute time back)")
    with tempfile.TemporaryDirectory() as tmp:
        binary = compile_floor(Path(tmp))
        print("load average (1, 5, 15 min) at start: %.2f %.2f %.2f" % os.getloadavg(), flush=True)
        samples = measure(binary, settings, 4 * args.values, args.rounds, args.round_trips)
        print("load average (1, 5, 15 min) at end: %.2f %.2f %.2f" % os.getloadavg())
    print(f"{'server between request and reply':44s} {'median':>8s} {'p90':>8s}  round trip - compute, us "
          f"({args.rounds} x {args.round_trips} round trips)")
    for setting, values in samples.items():
        print(f"{str(setting):44s} {statistics.median(values) / 1000:8.1f} {p90(values) / 1000:8.1f}")


if __name__ == "__main__":
    main()
