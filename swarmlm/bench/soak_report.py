"""The soak's report (swarmlm/bench/soak.py writes the files it reads): requests per client kind, wrong answers,
errors, and per process its RSS, open files and threads from the first sample after `settle_s` to the last; a plot
of RSS over time per process with the faults marked (rss.png)."""
from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # (a line cut by a kill)
    return rows


def requests(out: Path) -> dict:
    by_kind: dict[str, Counter] = defaultdict(Counter)
    wrong, errors = [], Counter()
    for f in sorted(out.glob("client*.jsonl")):
        for r in _rows(f):
            if "kind" not in r:
                continue  # (its "ready" line)
            c = by_kind[r["kind"]]
            c["requests"] += 1
            c["ok"] += r["ok"]
            c["wrong"] += r["wrong"] is not None
            c["errors"] += r["error"] is not None
            if r["wrong"] is not None:
                wrong.append({"client": f.stem, **r})
            if r["error"] is not None:
                errors[r["error"][:160]] += 1
    total = sum(c["requests"] for c in by_kind.values())
    finished = sum(c["ok"] + c["wrong"] for c in by_kind.values())
    return {"requests": total, "finished": finished, "wrong": len(wrong),
            "finished_fraction": round(finished / total, 4) if total else None,
            "by_kind": {k: dict(v) for k, v in by_kind.items()}, "wrong_examples": wrong[:10],
            "errors": dict(errors.most_common(12))}


def processes(out: Path, settle_s: float) -> dict:
    """Per pid: its role, when first and last seen, and RSS / fds / threads at the first sample after settle_s
    and at the last sample; `whole_run`: seen in the first and the last sample."""
    samples = _rows(out / "samples.jsonl")
    if not samples:
        return {}
    first_pids = {p["pid"] for p in samples[0]["procs"]}
    last_pids = {p["pid"] for p in samples[-1]["procs"]}
    per: dict[int, dict] = {}
    for s in samples:
        for p in s["procs"]:
            row = per.setdefault(p["pid"], {"role": p["role"], "first_t": s["t"], "series": []})
            row["last_t"] = s["t"]
            row["series"].append((s["t"], p["rss_mb"], p["fds"], p["threads"]))
    result = {}
    for pid, row in per.items():
        settled = [x for x in row["series"] if x[0] >= settle_s] or row["series"][-1:]
        a, b = settled[0], row["series"][-1]
        result[pid] = {"role": row["role"], "first_t": row["first_t"], "last_t": row["last_t"],
                       "whole_run": pid in first_pids and pid in last_pids,
                       "rss_mb": [a[1], b[1]], "rss_growth": round((b[1] - a[1]) / a[1], 4) if a[1] else None,
                       "rss_peak_mb": max(x[1] for x in row["series"]),
                       "fds": [a[2], b[2]], "threads": [a[3], b[3]]}
    return result


def summary(out: Path, settle_s: float, end: dict) -> dict:
    procs = processes(out, settle_s)
    whole = {pid: p for pid, p in procs.items() if p["whole_run"] and p["role"] != "harness"}
    return {**requests(out), **end,
            "max_rss_growth_whole_run": max((p["rss_growth"] or 0 for p in whole.values()), default=None),
            "fd_growth_whole_run": max((p["fds"][1] - p["fds"][0] for p in whole.values()), default=None),
            "processes": {str(k): v for k, v in procs.items()}}


def plot(out: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    samples = _rows(out / "samples.jsonl")
    series: dict[tuple[int, str], list] = defaultdict(list)
    for s in samples:
        for p in s["procs"]:
            series[(p["pid"], p["role"])].append((s["t"] / 60, p["rss_mb"]))
    fig, ax = plt.subplots(figsize=(13, 6))
    last = max((x for pts in series.values() for x, _ in pts), default=0.0)
    for (pid, role), pts in sorted(series.items(), key=lambda kv: kv[0][1]):
        whole = pts[0][0] <= 0.5 and pts[-1][0] >= last - 0.5  # (lived the whole run: named in the legend)
        ax.plot([x for x, _ in pts], [y for _, y in pts], lw=1, alpha=1.0 if whole else 0.4,
                label=role if whole else None)
    colors = {"kill": "red", "hang": "orange", "partition": "blue", "move": "green", "relay": "purple"}
    for f in _rows(out / "faults.jsonl"):
        if "kind" in f:
            ax.axvline(f["t"] / 60, color=colors.get(f["kind"], "gray"), alpha=0.35, lw=1)
    ax.set_xlabel("minutes (faults: red kill, orange hang, blue partition, green move, purple relay)")
    ax.set_ylabel("RSS (MB)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="whole run")
    path = out / "rss.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown(s: dict) -> str:
    lines = [f"- requests: {s['requests']}, finished {s['finished']} ({s['finished_fraction']}), wrong {s['wrong']}",
             f"- faults: {s['faults']} (could not be applied: {len(s['fault_errors'])})",
             f"- sessions at the end: {s['sessions_at_end']}, prefix entries: {s['prefix_entries_at_end']}",
             f"- orphan processes 10 s after the stop: {len(s['orphans'])} {s['orphans'][:5]}",
             f"- largest RSS growth of a process alive the whole run (settled -> end): {s['max_rss_growth_whole_run']}",
             f"- largest growth of open files of such a process: {s['fd_growth_whole_run']}",
             "", "| kind | requests | ok | wrong | errors |", "|---|---|---|---|---|"]
    lines += [f"| {k} | {v.get('requests', 0)} | {v.get('ok', 0)} | {v.get('wrong', 0)} | {v.get('errors', 0)} |"
              for k, v in sorted(s["by_kind"].items())]
    lines += ["", "| process | pid | whole run | RSS MB (settled -> end, peak) | fds | threads |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {p['role']} | {pid} | {p['whole_run']} | {p['rss_mb'][0]} -> {p['rss_mb'][1]} "
              f"({p['rss_peak_mb']}) | {p['fds'][0]} -> {p['fds'][1]} | {p['threads'][0]} -> {p['threads'][1]} |"
              for pid, p in sorted(s["processes"].items(), key=lambda kv: kv[1]["role"]) if p["rss_peak_mb"] >= 50]
    if s["errors"]:
        lines += ["", "Errors (count):"] + [f"- {n} x `{e}`" for e, n in s["errors"].items()]
    return "\n".join(lines) + "\n"
