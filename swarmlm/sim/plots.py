"""Figures of one run under --out: latency distributions (CDFs) and per-server utilisation / cache occupancy."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and in CI
import matplotlib.pyplot as plt  # noqa: E402  (backend must be chosen first)
import numpy as np  # noqa: E402

from swarmlm.sim.metrics import STATUS_DONE, RequestOutcome  # noqa: E402


def _cdf(ax, values: Sequence[float], label: str) -> None:
    v = np.sort([x for x in values if not math.isnan(x)])
    if len(v):
        ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=label)


def plot_latencies(records: Sequence[RequestOutcome], path: Path, title: str = "") -> Path:
    done = [r for r in records if r.status == STATUS_DONE]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, label in zip(axes, ("per_token_s", "ttft_s", "wait_s"),
                              ("per-token time (s)", "time to first token (s)", "wait for slots (s)")):
        _cdf(ax, [getattr(r, key) for r in done], label)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    fig.suptitle(title or f"{len(done)} completed requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_servers(servers: Sequence[dict], path: Path, title: str = "", max_bars: int = 60) -> Path:
    """Bars per server (the `max_bars` busiest when there are more): compute utilisation and cache occupancy."""
    rows = sorted(servers, key=lambda s: -s["mean_cache_occupancy"])[:max_bars]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 0.25 * len(rows) + 2), 4))
    ax.bar(x - 0.2, [s["mean_cache_occupancy"] for s in rows], 0.4, label="mean cache occupancy")
    ax.bar(x + 0.2, [s["peak_cache_occupancy"] for s in rows], 0.4, label="peak cache occupancy")
    ax.plot(x, [s["busy_fraction"] for s in rows], "k.", label="busy fraction (>= 1 session)")
    ax.set_xticks(x, [s["server_id"] for s in rows], rotation=90, fontsize=7)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("fraction")
    ax.legend(fontsize=8)
    ax.set_title(title or "servers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_run(records: Sequence[RequestOutcome], summary: dict, out_dir: str | Path, title: str = "") -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [plot_latencies(records, out / "latency_cdf.png", title),
            plot_servers(summary.get("servers", []), out / "servers.png", title)]
