"""Where requests come from: Poisson at a rate, a fixed count, or a trace file of (arrival, input, output tokens).

Every process returns a plain, time-sorted tuple of `SimRequest`s generated up front from one seeded RNG, so the
same seed gives the same requests whatever placement or routing is simulated (the paper compares algorithms on
identical arrivals).
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

import numpy as np


@dataclass(frozen=True)
class SimRequest:
    request_id: int
    client_id: str  # the client that sends it (and holds embeddings / LM head)
    arrival_s: float  # simulated time of arrival, seconds since the start
    input_tokens: int  # prompt length, tokens
    output_tokens: int  # tokens to generate (>= 1; the first comes out of prefill)
    # the first prefix_tokens of the prompt are shared with other requests of the same prefix_id (a system prompt,
    # a conversation's earlier turns): servers that ran one keep it (sim/prefixes.py); "" = nothing shared
    prefix_id: str = ""
    prefix_tokens: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.prefix_tokens < self.input_tokens:
            raise ValueError(f"request {self.request_id}: prefix_tokens={self.prefix_tokens} must be in "
                             f"[0, input_tokens={self.input_tokens})")
        if not (math.isfinite(self.arrival_s) and self.arrival_s >= 0):
            raise ValueError(f"request {self.request_id}: arrival_s must be finite and >= 0, got {self.arrival_s}")
        if self.input_tokens < 1 or self.output_tokens < 1:
            raise ValueError(
                f"request {self.request_id}: input_tokens={self.input_tokens} and "
                f"output_tokens={self.output_tokens} must both be >= 1"
            )


@dataclass(frozen=True)
class ArrivalSpec:
    """What to generate. Exactly one of `count` / `duration_s` bounds a Poisson process; a trace needs neither."""

    kind: Literal["poisson", "fixed", "trace"]
    rate_per_s: float = 0.0  # Poisson rate, requests/s (poisson only)
    count: int | None = None  # number of requests (poisson: stop after this many; fixed: exactly this many)
    duration_s: float | None = None  # poisson: stop at the first arrival after this time
    interval_s: float = 0.0  # fixed: spacing between arrivals (0 = all at time 0)
    input_tokens: int = 20  # prompt length for generated requests, tokens
    output_tokens: int = 128  # generated tokens per request
    trace_path: str = ""  # trace: CSV or JSONL file

    def __post_init__(self) -> None:
        if self.kind not in ("poisson", "fixed", "trace"):
            raise ValueError(f"arrival kind must be poisson, fixed or trace, got {self.kind!r}")
        if self.kind == "poisson":
            if not self.rate_per_s > 0:
                raise ValueError(f"poisson arrivals need rate_per_s > 0, got {self.rate_per_s}")
            if (self.count is None) == (self.duration_s is None):
                raise ValueError(f"poisson arrivals need exactly one of count={self.count} / "
                                 f"duration_s={self.duration_s}")
        if self.kind == "fixed" and (self.count is None or self.count < 1):
            raise ValueError(f"fixed arrivals need count >= 1, got {self.count}")
        if self.count is not None and self.count < 0:
            raise ValueError(f"count must be >= 0, got {self.count}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if self.interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {self.interval_s}")
        if self.input_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"input_tokens={self.input_tokens} and output_tokens={self.output_tokens} must be >= 1")
        if self.kind == "trace" and not self.trace_path:
            raise ValueError("trace arrivals need trace_path")


def generate(spec: ArrivalSpec, clients: Sequence[str], seed: int) -> tuple[SimRequest, ...]:
    """Requests for `spec`, each sent by a client drawn uniformly (seeded) from `clients`."""
    if not clients:
        raise ValueError("at least one client is needed to send requests")
    rng = np.random.default_rng(seed)
    if spec.kind == "trace":
        return load_trace(spec.trace_path, clients, rng)
    if spec.kind == "poisson":
        times = _poisson_times(spec, rng)
    else:
        times = [i * spec.interval_s for i in range(spec.count or 0)]
    picks = rng.integers(0, len(clients), size=len(times))
    return tuple(
        SimRequest(i, clients[int(c)], float(t), spec.input_tokens, spec.output_tokens)
        for i, (t, c) in enumerate(zip(times, picks))
    )


def _poisson_times(spec: ArrivalSpec, rng: np.random.Generator) -> list[float]:
    # the first request arrives at 0 (as in the paper's simulator) so runs do not start with idle time
    if spec.count is not None:
        gaps = rng.exponential(1.0 / spec.rate_per_s, size=spec.count)
        if spec.count:
            gaps[0] = 0.0
        return np.cumsum(gaps).tolist()
    times, t = [0.0], 0.0
    assert spec.duration_s is not None
    while True:
        t += float(rng.exponential(1.0 / spec.rate_per_s))
        if t > spec.duration_s:
            return times
        times.append(t)


def load_trace(path: str | Path, clients: Sequence[str], rng: np.random.Generator) -> tuple[SimRequest, ...]:
    """A CSV (header arrival_s,input_tokens,output_tokens[,client]) or JSONL file of the same fields.

    Rows without a `client` (or naming an unknown one) are assigned a seeded random client. Rows are sorted by
    arrival time; ids follow that order.
    """
    path = Path(path)
    rows = _read_rows(path)
    if not rows:
        raise ValueError(f"trace {path} has no requests")
    known = set(clients)
    parsed = []
    for n, row in enumerate(rows, 1):
        try:
            arrival, l_in, l_out = float(row["arrival_s"]), int(row["input_tokens"]), int(row["output_tokens"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"trace {path} row {n}: need arrival_s, input_tokens, output_tokens ({exc})") from exc
        client = str(row.get("client") or "")
        parsed.append((arrival, n, l_in, l_out, client if client in known else ""))
    parsed.sort()
    picks = rng.integers(0, len(clients), size=len(parsed))
    return tuple(
        SimRequest(i, client or clients[int(pick)], arrival, l_in, l_out)
        for i, ((arrival, _, l_in, l_out, client), pick) in enumerate(zip(parsed, picks))
    )


def _read_rows(path: Path) -> list[dict]:
    text = path.read_text()
    if path.suffix in (".jsonl", ".json"):
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return list(csv.DictReader(line for line in text.splitlines() if line.strip() and not line.startswith("#")))
