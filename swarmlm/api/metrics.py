"""The gateway's own numbers over the last minutes: requests, tokens/s, time to first token, time per output token.

Kept in fixed time buckets (BUCKET_S wide, WINDOW_S long): memory stays constant however busy the gateway is,
and the monitor page draws the buckets as its live chart.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from swarmlm.stats import percentile

BUCKET_S = 5.0
WINDOW_S = 300.0


@dataclass
class _Bucket:
    start_s: float  # wall clock (time.time) of the bucket's start
    n_tokens: int = 0
    requests: int = 0
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)


class GatewayMetrics:
    def __init__(self, bucket_s: float = BUCKET_S, window_s: float = WINDOW_S) -> None:
        self.bucket_s = bucket_s
        self.buckets: deque[_Bucket] = deque(maxlen=int(window_s / bucket_s))
        self.lock = threading.Lock()  # tokens are counted from the event loop, read by /v1/swarm
        self.started_s = time.time()
        self.active_requests = 0
        self.total_requests = 0
        self.total_tokens = 0

    def _bucket(self) -> _Bucket:
        now = time.time()
        start = now - now % self.bucket_s
        if not self.buckets or self.buckets[-1].start_s < start:
            self.buckets.append(_Bucket(start))
        return self.buckets[-1]

    def request_started(self) -> None:
        with self.lock:
            self.active_requests += 1
            self.total_requests += 1
            self._bucket().requests += 1

    def request_ended(self) -> None:
        with self.lock:
            self.active_requests -= 1

    def token(self) -> None:
        with self.lock:
            self.total_tokens += 1
            self._bucket().n_tokens += 1

    def finished(self, ttft_s: float, tpot_s: float | None) -> None:
        """One choice ended: its time to first token and mean time per later token (None with one token)."""
        with self.lock:
            b = self._bucket()
            b.ttft_s.append(ttft_s)
            if tpot_s is not None:
                b.tpot_s.append(tpot_s)

    def snapshot(self, recent_s: float = 60.0) -> dict:
        """Rates and percentiles over the last `recent_s`, and every bucket of the window for the chart."""
        with self.lock:
            self._bucket()
            now = time.time()
            buckets = list(self.buckets)
            active, total_req, total_tok = self.active_requests, self.total_requests, self.total_tokens
        recent = [b for b in buckets if b.start_s >= now - recent_s]
        span_s = max(min(recent_s, now - self.started_s), 1e-9)
        ttft = [v for b in recent for v in b.ttft_s]
        tpot = [v for b in recent for v in b.tpot_s]
        return {
            "window_s": recent_s,
            "active_requests": active,
            "total_requests": total_req,
            "total_tokens": total_tok,
            "requests_per_s": sum(b.requests for b in recent) / span_s,
            "tokens_per_s": sum(b.n_tokens for b in recent) / span_s,
            "ttft_s": _pcts(ttft),
            "tpot_s": _pcts(tpot),
            "history": self._history(buckets, now),
        }

    def _history(self, buckets: list[_Bucket], now: float) -> list[dict]:
        """One point per bucket over the whole window, idle buckets included (0 tokens/s, no latency)."""
        by_start = {b.start_s: b for b in buckets}
        last = now - now % self.bucket_s
        points = []
        for k in range(self.buckets.maxlen - 1, -1, -1):
            start = last - k * self.bucket_s
            b = by_start.get(start) or _Bucket(start)
            if start < self.started_s - self.bucket_s:
                continue  # before the gateway started
            width_s = self.bucket_s if k else max(now - start, 1.0)  # the current bucket is still filling
            points.append({"t": start, "tokens_per_s": b.n_tokens / width_s, "requests": b.requests,
                           "ttft_p50_s": _num(percentile(b.ttft_s, 50)), "tpot_p50_s": _num(percentile(b.tpot_s, 50))})
        return points


def _num(v: float) -> float | None:
    return None if math.isnan(v) else v  # JSON has no NaN


def _pcts(values: list[float]) -> dict:
    return {"count": len(values), "p50": _num(percentile(values, 50)), "p90": _num(percentile(values, 90))}
