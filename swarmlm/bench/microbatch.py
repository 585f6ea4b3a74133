"""Micro-batch extension (MoLink): how many micro-batches to split the running requests into.

A pipeline of S stages is usually fed S micro-batches, so each stage has one to work on. Over slow links that is not
enough: while a micro-batch's activations cross a link, its stage has nothing to do. More micro-batches fill those
gaps, at the cost of smaller (less efficient) batches. MoLink's rule, with n = waiting + running requests:

    b = 1 if n <= 1;  b = 2 if n <= 2;
    otherwise the smallest b in 3..max_b with (b - 2) * T_comp >= 2 * T_trans, else max_b, where
      T_comp  = decode time of one micro-batch of ceil(n / b) requests + ~5 ms (per-step overhead),
      T_trans = one micro-batch's activations over the link + ~5 ms (per-message overhead).

The intuition: two micro-batches' worth of time is always in transit (out and back); the other b - 2 must carry
enough compute to cover it. Re-evaluate it as requests arrive and finish (it is cheap: at most 8 evaluations).
"""
from __future__ import annotations

import math
import threading
from typing import Callable

OVERHEAD_S = 5e-3  # MoLink's ~5 ms added to both times: scheduling, kernel launches, message handling


def choose_num_microbatches(n_requests: int, decode_time_s: Callable[[int], float],
                            transfer_time_s: Callable[[int], float], max_b: int = 10,
                            overhead_s: float = OVERHEAD_S) -> int:
    """decode_time_s(batch_size): one decode step of that many requests on the slowest stage (profiled);
    transfer_time_s(batch_size): that many requests' activations (one token each) over the slowest link."""
    if max_b < 3:
        raise ValueError(f"max_b must be >= 3, got {max_b}")
    if n_requests <= 1:
        return 1
    if n_requests <= 2:
        return 2
    for b in range(3, max_b + 1):
        size = math.ceil(n_requests / b)
        t_comp = decode_time_s(size) + overhead_s
        t_trans = transfer_time_s(size) + overhead_s
        if (b - 2) * t_comp >= 2 * t_trans:
            return b
    return max_b


def transfer_time_fn(hidden_size: int, bytes_per_value: int, bandwidth_bps: float,
                     rtt_s: float = 0.0) -> Callable[[int], float]:
    """T_trans without the overhead: a micro-batch's hidden states ([batch, 1, hidden]) over the link, plus the
    propagation delay when you want it counted (MoLink counts bits / bandwidth only: rtt_s=0)."""
    if bandwidth_bps <= 0:
        raise ValueError(f"bandwidth_bps must be > 0, got {bandwidth_bps}")
    return lambda batch: batch * hidden_size * bytes_per_value * 8 / bandwidth_bps + rtt_s


def decode_time_fn(decode_s_per_block: float, blocks: int, per_sequence_s: float = 0.0) -> Callable[[int], float]:
    """A simple profile: a decode step of the stage's blocks costs the announced per-block time, plus an optional
    per-sequence increment (CPU decode grows with the batch; a GPU's barely does)."""
    return lambda batch: blocks * (decode_s_per_block + per_sequence_s * max(batch - 1, 0))


class MicroBatchPlanner:
    """MoLink's rule fed by what the client measures, re-evaluated for every new group of requests.

    T_comp(size): a line a + c * size fitted to the slowest stage's compute time of recent decode steps (from the
    servers' per-step timings) and the servers' announced batch-1 decode profile. T_trans(size): the median network
    time of the slowest hop of those steps (propagation, gRPC and the transfer of that step's rows), plus the
    extra bytes of a larger micro-batch over the measured bandwidth. Until a decode step has been seen, `choose`
    returns the fallback (the route's depth, as without the extension)."""

    def __init__(self, bytes_per_row: int, profile_decode_s: float, bandwidth_bps: Callable[[], float],
                 max_b: int = 10, window: int = 256) -> None:
        self.bytes_per_row = bytes_per_row  # one token's hidden states for one sequence
        self.profile_decode_s = profile_decode_s  # slowest span, batch 1 (announced); 0 = unknown
        self.bandwidth_bps = bandwidth_bps
        self.max_b = max_b
        self.window = window
        self.samples: list[tuple[int, float, float]] = []  # (rows, slowest compute_s, slowest network_s)
        self.decisions: list[dict] = []
        self._lock = threading.Lock()  # sessions finish on several worker threads

    def observe(self, rows: int, steps) -> None:
        """Decode steps (one token) of a finished session of `rows` sequences: their slowest hop's times."""
        new = [(rows, max(h.compute_s for h in step.hops), max(h.network_s for h in step.hops))
               for step in steps if step.n_tokens == 1 and step.hops and not step.failovers]
        with self._lock:
            self.samples = (self.samples + new)[-self.window:]

    def decode_time(self, size: int) -> float:
        points = [(r, c) for r, c, _ in self.samples]
        if self.profile_decode_s > 0:
            points.append((1, self.profile_decode_s))
        xs = {x for x, _ in points}
        if len(xs) < 2:  # one batch size seen: assume time proportional to rows (CPU decode, the pessimistic case)
            x0 = sum(x for x, _ in points) / len(points)
            return sum(y for _, y in points) / len(points) * size / x0
        n = len(points)
        mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
        slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
        return max(my + max(slope, 0.0) * (size - mx), 1e-6)

    def transfer_time(self, size: int) -> float:
        nets = sorted(n for _, _, n in self.samples)
        rows = sorted(r for r, _, _ in self.samples)
        median_net, median_rows = nets[len(nets) // 2], rows[len(rows) // 2]
        extra = max(size - median_rows, 0) * self.bytes_per_row * 8 / self.bandwidth_bps()
        return median_net + extra

    def choose(self, n_requests: int, fallback: int) -> int:
        if not self.samples:
            b = max(1, min(fallback, n_requests))
            self.decisions.append({"requests": n_requests, "micro_batches": b, "reason": "no measurement yet"})
            return b
        b = min(choose_num_microbatches(n_requests, self.decode_time, self.transfer_time, max_b=self.max_b),
                n_requests)
        size = math.ceil(n_requests / b)
        self.decisions.append({"requests": n_requests, "micro_batches": b, "t_comp_s": self.decode_time(size),
                               "t_trans_s": self.transfer_time(size)})
        return b
