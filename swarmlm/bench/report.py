"""Write a benchmark's results: results.json, CSVs, plots (matplotlib, Agg) and report.md that shows them.

    DIR/results.json    {"config": ..., "runs": [...]}; each run has servers, strategy, throughput_tokens_per_s,
                        mean_response_s, decomposition_s {computation, communication, queueing, orchestration},
                        telemetry per process, and requests [{response_s, ttft_s, generated_tokens, ...}]
    DIR/runs.csv        one row per (N, strategy)
    DIR/requests.csv    one row per request
    DIR/telemetry.csv   every sample (N, t_s, process, cpu %, rss, tx/rx bytes, rtt)
    DIR/*.png           response time / throughput / decomposition / network bytes against N, telemetry over time
    DIR/report.md
"""
from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path
from typing import Sequence

from swarmlm.bench.decomposition import PARTS
from swarmlm.machine import machine_info, machine_line

_RUN_COLUMNS = ["servers", "strategy", "strategy_label", "network", "in_flight", "requests_count", "failed",
                "generated_tokens", "makespan_s", "throughput_tokens_per_s", "mean_response_s", "mean_ttft_s",
                "mean_per_token_s", "p50_ttft_s", "p90_ttft_s", "p50_per_token_s", "p90_per_token_s",
                "efficiency_s_per_token", "speedup_throughput", "speedup_response", "speculative",
                "tokens_per_pass", "round_trips_per_token", "acceptance_rate", "drafted_tokens", "payload_bytes", "network_tx_bytes", "load_avg_1min_at_start"]
_REQUEST_COLUMNS = ["request_id", "input_tokens", "generated_tokens", "response_s", "ttft_s", "per_token_s",
                    "batch_size", "start_s", "end_s", "payload_sent_bytes", "payload_received_bytes", "error"]


def config_dict(config) -> dict:
    if config is None:
        return {}
    return json.loads(json.dumps(dataclasses.asdict(config), default=str))


def write_results(out_dir: str | Path, config, runs: Sequence[dict], telemetry: Sequence[dict],
                  notes: dict | None = None, machine: dict | None = None) -> Path:
    """results.json and the CSVs (safe to call after every N: each call rewrites them whole). `machine`: where the
    runs ran (default this machine, swarmlm/machine.py)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"config": config_dict(config), "machine": machine or machine_info(), "notes": notes or {},
           "runs": list(runs)}
    (out / "results.json").write_text(json.dumps(_compact(doc), indent=1))
    with open(out / "runs.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(_RUN_COLUMNS + [f"{p}_s" for p in PARTS] + ["residual_s"])
        for r in runs:
            w.writerow([_cell(r.get(c)) for c in _RUN_COLUMNS] + [_cell(r["decomposition_s"][p]) for p in PARTS]
                       + [_cell(r["decomposition_residual_s"])])
    with open(out / "requests.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["servers", "strategy"] + _REQUEST_COLUMNS + [f"{p}_s" for p in PARTS])
        for r in runs:
            for q in r["requests"]:
                w.writerow([r["servers"], r["strategy"]] + [_cell(q.get(c)) for c in _REQUEST_COLUMNS]
                           + [_cell(q["decomposition_s"][p]) for p in PARTS])
    with open(out / "telemetry.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["servers", "t_s", "process", "cpu_percent", "rss_bytes", "tx_bytes", "rx_bytes", "rtt_s"])
        for t in telemetry:
            for row in t["rows"]:
                w.writerow([t["servers"], *row])
    return out / "results.json"


def _compact(x):
    """Floats to 6 significant digits (microseconds on seconds, bytes exact below a MB): a smaller file."""
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {k: _compact(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_compact(v) for v in x]
    return x


def _cell(x):
    return f"{x:.6g}" if isinstance(x, float) else ("" if x is None else x)


# ---- plots -----------------------------------------------------------------------------------------------

def _by_strategy(runs: Sequence[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in sorted(runs, key=lambda r: r["servers"]):
        out.setdefault(r["strategy"], []).append(r)
    return out


def plot_all(out_dir: str | Path, runs: Sequence[dict], telemetry: Sequence[dict], title: str = "") -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    files = []
    groups = _by_strategy(runs)

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
        files.append(name)

    for key, ylabel, name in (("mean_response_s", "mean response time (s)", "response_vs_n.png"),
                              ("throughput_tokens_per_s", "generated tokens / s", "throughput_vs_n.png"),
                              ("efficiency_s_per_token", "response time per generated token (s)",
                               "efficiency_vs_n.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for strategy, rs in groups.items():
            ax.plot([r["servers"] for r in rs], [r[key] for r in rs], marker="o", label=strategy)
        ax.set_xlabel("servers N")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title} {ylabel}".strip(), fontsize=9)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, name)

    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 4), sharey=True, squeeze=False)
    colors = {"computation": "#4c72b0", "communication": "#dd8452", "queueing": "#c44e52", "orchestration": "#55a868"}
    for ax, (strategy, rs) in zip(axes[0], groups.items()):
        xs = [str(r["servers"]) for r in rs]
        bottom = [0.0] * len(rs)
        for part in PARTS:
            ys = [r["decomposition_s"][part] for r in rs]
            ax.bar(xs, ys, bottom=bottom, color=colors[part], label=part)
            bottom = [b + y for b, y in zip(bottom, ys)]
        ax.plot(xs, [r["mean_response_s"] for r in rs], "k_", markersize=18, label="measured")
        ax.set_title(strategy)
        ax.set_xlabel("servers N")
    axes[0][0].set_ylabel("mean response time (s)")
    axes[0][-1].legend(fontsize=8)
    save(fig, "decomposition.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for strategy, rs in groups.items():
        ax.plot([r["servers"] for r in rs], [r["network_tx_bytes"] / 1e6 for r in rs], marker="o",
                label=f"{strategy} (TCP, all processes)")
        ax.plot([r["servers"] for r in rs], [r["payload_bytes"] / 1e6 for r in rs], marker="x", ls="--",
                label=f"{strategy} (tensor payload)")
    ax.set_xlabel("servers N")
    ax.set_ylabel("MB per run")
    ax.set_title(f"{title} network bytes".strip(), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, "network_bytes_vs_n.png")

    if telemetry:
        files.append(_plot_telemetry(out, telemetry, title, plt))
    return files


def _plot_telemetry(out: Path, telemetry: Sequence[dict], title: str, plt) -> str:
    """CPU % and RSS of every process over the whole benchmark; swarms laid end to end, runs shaded."""
    fig, (cpu_ax, rss_ax, rtt_ax) = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    offset = 0.0
    all_names = sorted({r[1] for t in telemetry for r in t["rows"]}, key=lambda s: (s != "client", s))
    palette = plt.get_cmap("tab10")
    color = {name: ("k" if name == "system" else palette(i % 10)) for i, name in enumerate(all_names)}
    labelled: set[str] = set()
    for t in telemetry:
        rows = t["rows"]
        if not rows:
            continue
        names = sorted({r[1] for r in rows}, key=lambda s: (s != "client", s))
        for name in names:
            mine = [r for r in rows if r[1] == name]
            xs = [offset + r[0] for r in mine]
            label = name if name not in labelled else None  # one legend entry per process
            labelled.add(name)
            cpu_ax.plot(xs, [r[2] for r in mine], lw=0.8, color=color[name], ls=":" if name == "system" else "-",
                        label=label)
            if name != "system":
                rss_ax.plot(xs, [r[3] / 2**20 for r in mine], lw=0.8, color=color[name])
            if any(r[6] is not None for r in mine):
                rtt_ax.plot(xs, [float("nan") if r[6] is None else r[6] * 1e3 for r in mine], lw=0.6,
                            color=color[name])
        for w in t["windows"]:
            cpu_ax.axvspan(offset + w["t_from"], offset + w["t_to"], alpha=0.08,
                           color={"sequential": "b", "pipelined": "g"}.get(w["strategy"], "r"))
        cpu_ax.text(offset, -25, f"N={t['servers']}", fontsize=7)
        offset += rows[-1][0] + 5
    cpu_ax.legend(fontsize=6, ncol=6, loc="upper right")
    cpu_ax.set_ylabel("CPU % (100 = 1 core)")
    cpu_ax.set_title(f"{title} telemetry: each process (lines), whole machine (dotted); runs shaded "
                     "(blue seq, green pipe, red micro)".strip(), fontsize=8)
    rss_ax.set_ylabel("RSS (MiB)")
    rtt_ax.set_ylabel("Info RTT to servers (ms)")
    rtt_ax.set_yscale("log")
    rtt_ax.set_xlabel("seconds (swarms one after another)")
    fig.tight_layout()
    fig.savefig(out / "telemetry.png", dpi=90)
    plt.close(fig)
    return "telemetry.png"


# ---- report.md -------------------------------------------------------------------------------------------

def _pair(run: dict, key: str, scale: float, fmt: str) -> str:
    """'p50 / p90' of a run's percentiles (runs written before they existed show '-')."""
    if f"p50_{key}" not in run:
        return "-"
    return f"{run[f'p50_{key}'] * scale:{fmt}} / {run[f'p90_{key}'] * scale:{fmt}}"


def _trips(r: dict) -> str:
    """tokens / pass | trips / token | acceptance (runs written before these existed: blanks)."""
    if "tokens_per_pass" not in r:
        return " | | "
    acc, drafted = r.get("acceptance_rate"), r.get("drafted_tokens", 0)
    accepted = "" if acc is None else f"{acc:.0%} of {drafted}"
    return f"{r['tokens_per_pass']:.2f} | {r['round_trips_per_token']:.2f} | {accepted}"


def write_report(out_dir: str | Path, runs: Sequence[dict], title: str, intro: str = "") -> Path:
    out = Path(out_dir)
    lines = [f"# {title}", ""]
    if intro:
        lines += [intro, ""]
    results = out / "results.json"
    machine = json.loads(results.read_text()).get("machine") if results.exists() else None
    lines += [f"Machine: {machine_line(machine) if machine else 'not recorded'}.", ""]
    lines += ["| N | strategy | requests | tokens/s | speed-up | mean response s | TTFT s | TTFT p50 / p90 s | "
              "TPOT p50 / p90 ms | s/token | compute | comm | queue | orch | residual | tokens / pass | trips / token | "
              "accepted | MB on the wire | CPU ours / machine % | load |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: (r["strategy"], r["servers"])):
        d = r["decomposition_s"]
        sp = r.get("speedup_throughput")
        lines.append(
            f"| {r['servers']} | {r['strategy_label']} | {r['requests_count'] - r['failed']}/{r['requests_count']} | "
            f"{r['throughput_tokens_per_s']:.2f} | {'' if sp is None else f'{sp:.2f}x'} | "
            f"{r['mean_response_s']:.2f} | {r['mean_ttft_s']:.2f} | {_pair(r, 'ttft_s', 1, '.2f')} | "
            f"{_pair(r, 'per_token_s', 1e3, '.1f')} | {r['efficiency_s_per_token']:.3f} | "
            f"{d['computation']:.2f} | {d['communication']:.2f} | {d['queueing']:.2f} | {d['orchestration']:.2f} | "
            f"{r['decomposition_residual_s']:+.3f} | {_trips(r)} | {r['network_tx_bytes'] / 1e6:.1f} | {_cpu(r)} | "
            f"{r['load_avg_1min_at_start']:.1f} |")
    lines += ["", "TTFT: time to first token; TPOT: time per output token after the first (per request; p50 / p90 "
              "over requests); s/token: response time / generated tokens. Speed-up: throughput against N = 1 of the "
              "same strategy. Decomposition: mean seconds per request "
              "(computation = server blocks + client embeddings/LM head/sampling). Tokens / pass: generated tokens per step "
              "through the route (the prompt's included; > 1 with speculation); trips / token: client round trips per "
              "token (a relayed step makes one per server, a pushed one a single trip along the chain); accepted: "
              "speculation's drafts accepted / sent (--speculative). MB on the wire: TCP payload sent "
              "by all tracked processes during the run. CPU: mean over the run of the benchmark's own processes "
              "(client, servers, DHT, relay) against the whole machine, in % of one core. Load: the 1-minute load "
              "average as the run started.", ""]
    for name, caption in (("throughput_vs_n.png", "Generated throughput against N"),
                          ("response_vs_n.png", "Mean end-to-end response time against N"),
                          ("efficiency_vs_n.png", "Token-normalised efficiency (response time per generated token)"),
                          ("decomposition.png", "Decomposition of the mean response time"),
                          ("network_bytes_vs_n.png", "Network bytes per run against N"),
                          ("telemetry.png", "Telemetry over the whole benchmark")):
        if (out / name).exists():
            lines += [f"![{caption}]({name})", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _cpu(run: dict) -> str:
    tel = run.get("telemetry", {})
    ours = sum(v["mean_cpu_percent"] for k, v in tel.items() if k != "system")
    machine = tel.get("system", {}).get("mean_cpu_percent")
    return f"{ours:.0f} / {machine:.0f}" if machine is not None else f"{ours:.0f} / ?"


# ---- rebuild from files (e.g. after an interrupted run) ----------------------------------------------------

def load(out_dir: str | Path) -> tuple[list[dict], list[dict]]:
    """runs from results.json and the telemetry series from telemetry.csv, as the runner produced them."""
    out = Path(out_dir)
    runs = json.loads((out / "results.json").read_text())["runs"]
    telemetry: dict[int, dict] = {}
    path = out / "telemetry.csv"
    if path.exists():
        with open(path, newline="") as fh:
            for row in csv.DictReader(fh):
                n = int(row["servers"])
                t = telemetry.setdefault(n, {"servers": n, "rows": [], "windows": []})
                t["rows"].append([float(row["t_s"]), row["process"], float(row["cpu_percent"]), int(row["rss_bytes"]),
                                  int(row["tx_bytes"]), int(row["rx_bytes"]),
                                  float(row["rtt_s"]) if row["rtt_s"] else None])
    for r in runs:
        if r["servers"] in telemetry:
            telemetry[r["servers"]]["windows"].append(
                {"strategy": r["strategy"], "t_from": r["window_s"][0], "t_to": r["window_s"][1]})
    return runs, [telemetry[n] for n in sorted(telemetry)]


def merge(out_dir: str | Path, sources: Sequence[str | Path]) -> tuple[list[dict], list[dict]]:
    """Runs of several result directories (e.g. swarm sizes run one invocation each) as one result in out_dir.

    A swarm size present in more than one source is taken from the first; speed-ups are recomputed."""
    from swarmlm.bench.runner import add_speedups

    runs, telemetry, seen = [], [], set()
    for src in sources:
        more_runs, more_tel = load(src)
        sizes = {r["servers"] for r in more_runs} - seen
        runs += [r for r in more_runs if r["servers"] in sizes]
        telemetry += [t for t in more_tel if t["servers"] in sizes]
        seen |= sizes
    runs.sort(key=lambda r: r["servers"])
    telemetry.sort(key=lambda t: t["servers"])
    add_speedups(runs)
    doc = json.loads((Path(sources[0]) / "results.json").read_text())
    notes = dict(doc.get("notes", {}), merged_from=[str(s) for s in sources])
    _write_merged(out_dir, doc["config"], runs, telemetry, notes, doc.get("machine"))
    return runs, telemetry


def _write_merged(out_dir, config: dict, runs, telemetry, notes, machine: dict | None = None) -> None:
    """write_results takes the runner's dataclass; a loaded config is already a dict, so it is put back after."""
    out = Path(out_dir)
    write_results(out, None, runs, telemetry, notes, machine)
    doc = json.loads((out / "results.json").read_text())
    doc["config"] = config
    (out / "results.json").write_text(json.dumps(_compact(doc), indent=1))


def main(argv: list[str] | None = None) -> None:
    """`python -m swarmlm.bench.report DIR [--merge SRC ...] [--title T]`: plots and report.md again from DIR's
    files, or from several result directories merged into DIR."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--merge", nargs="+", help="result directories to combine into out_dir")
    parser.add_argument("--title", default="swarmlm bench")
    args = parser.parse_args(argv)
    runs, telemetry = merge(args.out_dir, args.merge) if args.merge else load(args.out_dir)
    plot_all(args.out_dir, runs, telemetry, args.title)
    print(write_report(args.out_dir, runs, args.title))


if __name__ == "__main__":
    main()
