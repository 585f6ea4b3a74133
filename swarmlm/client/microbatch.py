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
