"""routing_bench's uncalibrated simulation re-run from its saved JSONs (docs/results/routing_bench*.json), each
hop's message cost o = 0 (as when they were made) beside the performance model's default, against the measured
per-token times (docs/RESULTS-routing.md, "The message cost in the model").

Usage: .venv/bin/python benchmarks/routing_resimulate.py   (from the repository's root)
"""
import json
import sys

sys.path.insert(0, "benchmarks")
from routing_bench import MODES, simulate, summary  # noqa: E402

for f in ["routing_bench.json", "routing_bench_16.json", "routing_bench_pinned.json", "routing_bench_16_pinned.json"]:
    r = json.load(open(f"docs/results/{f}"))
    a = r["args"]; ready = r["profiles"]; ids = list(ready)
    names = {ids[0]: "A", ids[1]: "B"}
    for mode in MODES:
        real = r["real"][mode]
        out = []
        for o in (0.0, None):
            rows = simulate(ready, r["client_rtt_s"][mode], 8, a["gap"], a["input"], a["output"], a["background"],
                            mode, message_overhead_s=o)
            sim = summary(rows, names)
            out.append((sim["mean_per_token_ms"], sim["share"]["A"]))
        real_a = real["share"][list(real["share"])[0]]
        print(f"{f:30s} {mode:14s} real {real['mean_per_token_ms']:6.1f} (A {real_a:.2f})"
              f"  sim o=0 {out[0][0]:6.2f} (A {out[0][1]:.2f})  sim o=1.2ms {out[1][0]:6.2f} (A {out[1][1]:.2f})")
