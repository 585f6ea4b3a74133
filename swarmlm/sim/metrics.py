"""Per-request records and the summary of a run, written as JSON and CSV.

Definitions (the paper's, so numbers compare with it):
- wait_s: arrival -> the session holds cache slots on every server of its route (retries and backoff included).
- ttft_s: arrival -> first token at the client (wait + prefill through the route).
- per_token_s: (finish - arrival) / output_tokens, the paper's "average per-token time"; it includes wait and
  prefill, which is why TTFT dominates it at 20-in / 64-out.
- decode_per_token_s: (finish - first token) / (output_tokens - 1), the steady decode step.
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Sequence

import numpy as np

from swarmlm.stats import percentile
from swarmlm.types import Span, describe_spans

STATUS_DONE = "done"
STATUS_TIMEOUT = "timeout"  # gave up waiting for cache slots after the client's timeout, like the real client


@dataclass(frozen=True)
class RequestOutcome:
    request_id: int
    client_id: str
    status: str  # STATUS_DONE | STATUS_TIMEOUT
    arrival_s: float
    input_tokens: int
    output_tokens: int
    wait_s: float  # arrival -> slots held on the whole route (for a timeout: arrival -> giving up)
    start_s: float  # simulated time the slots were obtained (NaN if timed out)
    ttft_s: float  # arrival -> first token; NaN if timed out
    per_token_s: float  # (finish - arrival) / output_tokens; NaN if timed out
    decode_per_token_s: float  # mean decode step after the first token; NaN if timed out or output_tokens == 1
    finish_s: float  # simulated time of the last token (or of giving up)
    attempts: int  # admission attempts (1 = admitted at once)
    hops: int  # servers on the route that finally served it (0 if timed out)
    route: tuple[Span, ...]  # the route that finally served it (empty if timed out)

    def __post_init__(self) -> None:
        if self.status not in (STATUS_DONE, STATUS_TIMEOUT):
            raise ValueError(f"request {self.request_id}: unknown status {self.status!r}")
        if self.finish_s < self.arrival_s or self.wait_s < 0:
            raise ValueError(f"request {self.request_id}: finish {self.finish_s} before arrival {self.arrival_s}")


@dataclass(frozen=True)
class ServerUsage:
    server_id: str
    start: int  # first block served
    end: int  # one past the last block
    slots: int  # cache slots (one slot = one session's cache for one block)
    sessions: int  # sessions served
    compute_s: float  # seconds of block compute done for sessions (prefill + decode)
    busy_s: float  # seconds with at least one session holding slots here
    slot_s: float  # integral of used slots over time (slot-seconds)
    peak_slots: int  # most slots in use at once (never above `slots`)


def _stats(values: Sequence[float]) -> dict[str, float]:
    finite = [v for v in values if not math.isnan(v)]
    mean = float(np.mean(finite)) if finite else math.nan
    return {"mean": mean, "p50": percentile(finite, 50), "p90": percentile(finite, 90), "p99": percentile(finite, 99)}


def summarize(records: Sequence[RequestOutcome], servers: Sequence[ServerUsage], end_time_s: float) -> dict:
    """The headline numbers plus per-server utilisation; flat keys first so `--json` stays easy to read."""
    done = [r for r in records if r.status == STATUS_DONE]
    duration = max(end_time_s, 1e-12)
    per_token, ttft = _stats([r.per_token_s for r in done]), _stats([r.ttft_s for r in done])
    wait, decode = _stats([r.wait_s for r in done]), _stats([r.decode_per_token_s for r in done])
    latency = _stats([r.finish_s - r.arrival_s for r in done])
    out = {
        "requests": len(records),
        "completed": len(done),
        "timed_out": sum(r.status == STATUS_TIMEOUT for r in records),
        "mean_per_token_s": per_token["mean"],
        "p50_per_token_s": per_token["p50"],
        "p90_per_token_s": per_token["p90"],
        "p99_per_token_s": per_token["p99"],
        "mean_ttft_s": ttft["mean"],
        "p50_ttft_s": ttft["p50"],
        "p90_ttft_s": ttft["p90"],
        "p99_ttft_s": ttft["p99"],
        "mean_wait_s": wait["mean"],
        "p50_wait_s": wait["p50"],
        "p90_wait_s": wait["p90"],
        "p99_wait_s": wait["p99"],
        "mean_decode_per_token_s": decode["mean"],
        "mean_latency_s": latency["mean"],
        "p90_latency_s": latency["p90"],
        "makespan_s": end_time_s,
        "throughput_req_per_s": len(done) / duration,
        "throughput_tokens_per_s": sum(r.output_tokens for r in done) / duration,
        "mean_hops": float(np.mean([r.hops for r in done])) if done else math.nan,
        "servers": [_server_summary(s, duration) for s in servers],
    }
    return out


def _server_summary(s: ServerUsage, duration: float) -> dict:
    return {
        "server_id": s.server_id,
        "blocks": f"{s.start}:{s.end}",
        "slots": s.slots,
        "sessions": s.sessions,
        # compute seconds / wall seconds: may exceed 1 because the performance model treats concurrent sessions as
        # batched (a step's time does not grow with the number of sessions, the paper's measured property)
        "compute_utilisation": s.compute_s / duration,
        "busy_fraction": s.busy_s / duration,
        "mean_cache_occupancy": (s.slot_s / duration / s.slots) if s.slots else 0.0,
        "peak_cache_occupancy": (s.peak_slots / s.slots) if s.slots else 0.0,
        "peak_slots": s.peak_slots,
    }


def _jsonable(x):
    """NaN is not JSON: write null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_jsonable(v) for v in x]
    return x


def to_json(summary: dict) -> str:
    return json.dumps(_jsonable(summary), indent=2, allow_nan=False)


def write_outputs(out_dir: str | Path, records: Sequence[RequestOutcome], summary: dict) -> list[Path]:
    """requests.csv, servers.csv and summary.json under `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    req_path, srv_path, sum_path = out / "requests.csv", out / "servers.csv", out / "summary.json"
    with req_path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow([fl.name for fl in fields(RequestOutcome)])
        for r in records:
            w.writerow([describe_spans(r.route) if f.name == "route" else getattr(r, f.name)
                        for f in fields(RequestOutcome)])
    with srv_path.open("w", newline="") as f:
        rows = summary.get("servers", [])
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["server_id"])
        w.writeheader()
        w.writerows(rows)
    sum_path.write_text(to_json(summary) + "\n")
    return [req_path, srv_path, sum_path]
