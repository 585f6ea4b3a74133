"""The test suite on a busy machine: runs the tests N times while a CPU hog keeps every core busy.

    .venv/bin/python benchmarks/busy_suite.py                       # `make test`'s command, 5 runs
    .venv/bin/python benchmarks/busy_suite.py --runs 3 tests/test_batching.py tests/test_netem_testbed.py
    .venv/bin/python benchmarks/busy_suite.py --runs 10 tests/test_batching.py -k lockstep
    .venv/bin/python benchmarks/busy_suite.py --hogs 0 --runs 1     # the same without the hog, for comparison

The hog is one Python busy-loop process per core (no stress-ng needed), started before the first run and stopped
after the last one (also on Ctrl-C). Prints each run's outcome, pytest's summary line and wall time, then one
summary line; exits non-zero if any run failed. Each run's full output goes to --log-dir.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTEST = [sys.executable, "-m", "pytest", "-q", "-x", "-n", "2", "--dist", "loadfile", "--durations=15"]  # what `make test` runs

HOG = "while True:\n    pass\n"


def start_hogs(count: int) -> list[subprocess.Popen]:
    # own sessions, so a Ctrl-C at the terminal reaches us and we stop them ourselves
    return [subprocess.Popen([sys.executable, "-c", HOG], start_new_session=True) for _ in range(count)]


def stop_hogs(hogs: list[subprocess.Popen]) -> None:
    for hog in hogs:
        if hog.poll() is None:
            hog.kill()
    for hog in hogs:
        hog.wait()


def summary_line(output: str) -> str:
    """pytest's last line that counts outcomes, e.g. '3 passed, 1 failed in 12.3s'."""
    for line in reversed(output.splitlines()):
        if any(word in line for word in (" passed", " failed", " error", " skipped", "no tests ran")):
            return line.strip("= ").strip()
    return output.strip().splitlines()[-1] if output.strip() else "(no output)"


def first_failure(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return lines[0] if lines else ""


def run_once(selection: list[str], log: Path, timeout_s: float) -> tuple[bool, float, str]:
    started = time.monotonic()
    with open(log, "w") as out:
        try:
            proc = subprocess.run([*PYTEST, *selection], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=timeout_s)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
    wall = time.monotonic() - started
    text = log.read_text()
    if code is None:
        return False, wall, f"timed out after {timeout_s:.0f} s"
    line = summary_line(text)
    failure = first_failure(text)
    return code == 0, wall, line + (f"  [{failure}]" if failure and code != 0 else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("selection", nargs="*", help="pytest arguments (files, node ids, -k ...); default: all tests")
    parser.add_argument("--runs", type=int, default=5, help="how many times to run the tests (default 5)")
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 2,
                        help="busy-loop processes, one per core by default; 0 for none")
    parser.add_argument("--timeout", type=float, default=10800.0, help="seconds allowed per run (default 3 h)")
    parser.add_argument("--log-dir", default=None, help="where each run's output goes (default: a temp dir)")
    args, extra = parser.parse_known_args(argv)  # pytest options (-k, -m ...) pass through
    args.selection += extra
    if args.runs < 1 or args.hogs < 0:
        parser.error("--runs must be >= 1 and --hogs >= 0")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="swarmlm-busy-suite-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    what = " ".join(args.selection) or "the whole suite"
    machine = subprocess.run([sys.executable, "-c", "from swarmlm.machine import machine_line; print(machine_line())"],
                             cwd=ROOT, capture_output=True, text=True).stdout.strip()  # as the tests will see it
    print(f"machine: {machine}", flush=True)
    print(f"{what}: {args.runs} run(s) with {args.hogs} busy-loop process(es) on {os.cpu_count()} cores; "
          f"logs in {log_dir}", flush=True)
    hogs = start_hogs(args.hogs)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the hogs on `kill` too
    results = []
    try:
        for i in range(1, args.runs + 1):
            ok, wall, line = run_once(args.selection, log_dir / f"run{i}.log", args.timeout)
            results.append((ok, wall))
            print(f"run {i}/{args.runs}: {'PASS' if ok else 'FAIL'}  {wall:7.1f} s  {line}", flush=True)
    finally:
        stop_hogs(hogs)
        signal.signal(signal.SIGTERM, previous)
    passed = sum(ok for ok, _ in results)
    walls = sorted(wall for _, wall in results)
    print(f"summary: {passed}/{len(results)} runs passed with {args.hogs} hog(s); wall min/median/max "
          f"{walls[0]:.1f}/{walls[len(walls) // 2]:.1f}/{walls[-1]:.1f} s; load average now "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
