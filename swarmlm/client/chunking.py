"""Chunked prefill: how many prompt tokens go in one message, and what the link to each server can carry.

A step's tokens run causally on top of the server's cache, so a prefill sent as consecutive steps of c tokens
gives exactly the result of one step. Small chunks let decode messages pass between them on the link (see
wire/links.py), let the server start on the first chunk while the rest arrive, and let the client forward chunk k
to the next server while chunk k+1 is still on the previous one. But every chunk costs a fixed amount (the
server's per-step overhead, a gRPC message, the client's relay), so chunks should not be smaller than needed.

The rule (per hop; the route uses the largest of its hops' sizes, so no hop pays more than its bound):
    beta  = seconds per token on the link      = bytes per token * 8 / measured bandwidth
    a     = seconds per token on the server    = announced prefill slope * blocks * batch
    fixed = seconds per chunk on the server    = announced prefill intercept * blocks + message_overhead_s
    c     = fixed / max(beta - a, overhead_fraction * a)          clamped to [min_tokens, max_tokens]
When the link is slower than the server (beta > a), c is the smallest chunk whose transfer covers its compute,
fixed cost included: transfer(c) = compute(c), so the server never waits on a chunk's overhead while the link
is the bottleneck, and no chunk occupies the link longer than needed. When the server is the slower one, the
link never holds the server up, and c is the smallest chunk whose fixed cost is at most `overhead_fraction` of its
compute.
"""
from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable

import torch

from swarmlm.config import ChunkRule

def chunk_tokens_for_hop(rule: ChunkRule, bytes_per_token: int, bandwidth_bps: float, compute_s_per_token: float,
                         compute_fixed_s: float) -> int:
    """The rule above for one hop. compute_s_per_token and compute_fixed_s are the whole span's (all its blocks)."""
    beta = bytes_per_token * 8 / bandwidth_bps if bandwidth_bps > 0 else math.inf
    a = max(compute_s_per_token, 1e-9)
    fixed = compute_fixed_s + rule.message_overhead_s
    gap = max(beta - a, rule.overhead_fraction * a)
    c = math.ceil(fixed / gap) if math.isfinite(gap) else rule.min_tokens
    return int(min(max(c, rule.min_tokens), rule.max_tokens))


def split(hidden: torch.Tensor, mask: torch.Tensor, chunk_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """hidden: [B, T, H], mask: [B, T] -> consecutive pieces of at most chunk_tokens tokens (views, no copies)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    t = hidden.shape[1]
    if t <= chunk_tokens:  # one chunk (every decode step): the tensors themselves
        return [(hidden, mask)]
    return [(hidden[:, i:i + chunk_tokens], mask[:, i:i + chunk_tokens]) for i in range(0, t, chunk_tokens)]


class BandwidthEstimate:
    """What one link carries, from the client's own step timings (no extra probe traffic).

    A sample is a step whose request was written when nothing else of this client was in flight on the link:
    its network time (wall minus the server's queueing, compute and (de)serialising) is the RTT plus the request
    and reply bytes over the bandwidth. Only messages big enough for the transfer to show above the RTT's noise
    count. The estimate is the byte-weighted median of the recent samples' rates: a shaper's burst (a token
    bucket lets its first tens of KB through at once) makes a short prompt's 64 KB look ten times faster than the
    link, and it is the large messages whose pace the chunk rule needs. Until there is a sample, `default_bps`.
    """

    def __init__(self, default_bps: float, min_bytes: int = 32 << 10, window: int = 64, max_age_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.default_bps = default_bps
        self.min_bytes = min_bytes
        self.max_age_s = max_age_s  # older samples no longer count: a link's past load does not stay its rate
        self.clock = clock
        self._samples: deque[tuple[int, float, float]] = deque(maxlen=window)  # (bytes, bits per second, when)
        self.rtt_s: float | None = None  # smallest network time of a small message: the path's base cost

    def observe(self, bytes_total: int, network_s: float) -> None:
        if bytes_total < self.min_bytes:
            if self.rtt_s is None or network_s < self.rtt_s:
                self.rtt_s = network_s
            return
        transfer_s = network_s - (self.rtt_s or 0.0)
        if transfer_s <= 1e-4:  # within noise of the base cost: the link is much faster than this message shows
            return
        self._samples.append((bytes_total, bytes_total * 8 / transfer_s, self.clock()))

    def _recent(self) -> list[tuple[int, float, float]]:
        now = self.clock()
        while self._samples and now - self._samples[0][2] > self.max_age_s:
            self._samples.popleft()
        return list(self._samples)

    @property
    def measured(self) -> bool:
        return bool(self._recent())

    @property
    def bandwidth_bps(self) -> float:
        samples = self._recent()
        if not samples:
            return self.default_bps
        ranked = sorted(samples, key=lambda s: s[1])
        half, seen = sum(b for b, _, _ in ranked) / 2, 0
        for nbytes, rate, _ in ranked:
            seen += nbytes
            if seen >= half:
                break
        return rate
