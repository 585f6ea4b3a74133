"""Where a request's response time goes: computation, communication, queueing, orchestration.

Every part is read from a clock that brackets exactly that activity; none is "the total minus the rest":

  computation    server compute_s of every hop (the server's own clock around its blocks)
                 + the client's embeddings, LM head and sampling (GenerationStats' clocks)
  communication  per hop, the client's write->read wall minus what the server says it spent inside (queue,
                 compute, parse/serialise): bytes in flight, gRPC and event-loop delivery; plus the server's
                 parse/serialise and the client's serialise/parse clocks
  queueing       server queued_s (a step waiting for a busy compute thread) + time the request waited at the
                 client before a worker took it (open-loop arrivals only)
  orchestration  routing + opening the streams (session.open), closing them, failover (re-route + replay),
                 handing each step to the I/O loop and back, and the session's own work between hops

`measured_s` is the request's response time on its own clock; `residual_s` = measured - the four parts is what no
clock covers (the generation loop's bookkeeping between timers) and is reported, never folded into a part.

A chunked prefill is pipelined: chunk k runs on server 2 while chunk k+1 runs on server 1, so its hops' clocks add
up to more than the step's wall. Such a step's wall is shared among its hops' activities in proportion to their
clocks (each hop-derived part scaled by wall / sum of hop times), and what was removed is reported as
`detail_s["overlap"]` (time that two hops spent at once).
Server and client run on one machine here, so their clocks tick at the same rate (CLOCK_MONOTONIC).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

PARTS = ("computation", "communication", "queueing", "orchestration")


@dataclass(frozen=True)
class Decomposition:
    computation_s: float
    communication_s: float
    queueing_s: float
    orchestration_s: float
    measured_s: float  # the response time being explained
    detail_s: dict[str, float] = field(default_factory=dict, hash=False, compare=False)  # the clocks behind the parts

    @property
    def accounted_s(self) -> float:
        return self.computation_s + self.communication_s + self.queueing_s + self.orchestration_s

    @property
    def residual_s(self) -> float:
        return self.measured_s - self.accounted_s

    @property
    def residual_fraction(self) -> float:
        return abs(self.residual_s) / self.measured_s if self.measured_s > 0 else 0.0

    def parts(self) -> dict[str, float]:
        return {p: getattr(self, f"{p}_s") for p in PARTS}

    def to_dict(self) -> dict:
        return {**self.parts(), "measured": self.measured_s, "residual": self.residual_s,
                "detail": dict(self.detail_s)}


def decompose(measured_s: float, open_s: float, close_s: float, client_wait_s: float, stats,
              call_s: Sequence[float], steps: Sequence) -> Decomposition:
    """stats: GenerationStats of the request; call_s: the wall of each session.step() call as the caller saw it;
    steps: the session's StepRecords (one per call, in order)."""
    if len(call_s) != len(steps):
        raise ValueError(f"{len(call_s)} timed step calls but {len(steps)} step records")
    d: dict[str, float] = dict.fromkeys((
        "server_compute", "client_embed", "client_head", "client_sample", "transfer", "server_serialise",
        "client_serialise", "server_queue", "client_queue", "open", "close", "failover", "dispatch", "hop_gaps",
        "overlap",
    ), 0.0)
    hop_parts = ("server_compute", "server_queue", "server_serialise", "client_serialise", "transfer")
    d["client_embed"], d["client_head"], d["client_sample"] = stats.embed_s, stats.head_s, stats.sample_s
    d["client_queue"], d["open"], d["close"] = client_wait_s, open_s, close_s
    for call, step in zip(call_s, steps):
        h = dict.fromkeys(hop_parts, 0.0)
        for hop in step.hops:
            h["server_compute"] += hop.compute_s
            h["server_queue"] += hop.queued_s
            h["server_serialise"] += hop.server_io_s
            h["client_serialise"] += hop.client_io_s
            # the client's round trip minus the server's own time inside it: bytes on the wire and their delivery
            h["transfer"] += hop.wall_s - hop.queued_s - hop.compute_s - hop.server_io_s
        in_hops = sum(h.values())  # = the hops' wall + client_io
        wall = step.wall_s - step.failover_s
        scale = wall / in_hops if in_hops > wall > 0 else 1.0  # < 1 only where hops overlapped (pipelined chunks)
        for k, v in h.items():
            d[k] += v * scale
        d["overlap"] += in_hops * (1 - scale)
        d["failover"] += step.failover_s
        d["hop_gaps"] += wall - in_hops * scale  # the session's loop between hops (and failed tries)
        d["dispatch"] += call - step.wall_s  # sync caller -> I/O loop thread -> back
    return Decomposition(
        computation_s=d["server_compute"] + d["client_embed"] + d["client_head"] + d["client_sample"],
        communication_s=d["transfer"] + d["server_serialise"] + d["client_serialise"],
        queueing_s=d["server_queue"] + d["client_queue"],
        orchestration_s=d["open"] + d["close"] + d["failover"] + d["dispatch"] + d["hop_gaps"],
        measured_s=measured_s, detail_s=d,
    )


def mean_decomposition(items: Sequence[Decomposition]) -> Decomposition:
    """Per-request average (each request weighs the same, as in a mean response time)."""
    if not items:
        return Decomposition(0.0, 0.0, 0.0, 0.0, 0.0)
    n = len(items)
    keys = sorted({k for x in items for k in x.detail_s})
    return Decomposition(
        *(sum(getattr(x, f"{p}_s") for x in items) / n for p in PARTS),
        measured_s=sum(x.measured_s for x in items) / n,
        detail_s={k: sum(x.detail_s.get(k, 0.0) for x in items) / n for k in keys},
    )
