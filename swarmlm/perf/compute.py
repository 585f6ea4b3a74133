"""A server's compute times (ComputeProfile): fitted per block from its start-up measurements (perf/profile.py),
announced in its record; how one step, a prompt or a decode, is priced, and how decode slows with load."""
from __future__ import annotations

from dataclasses import dataclass

from swarmlm.perf.nonnegative import check_nonneg

CONTENTION_ROWS = (4, 16)  # decode rows (concurrent sessions) at which a profile measures a batched forward


@dataclass(frozen=True)
class ComputeProfile:
    """Per-block compute time of one server, fitted from measurements (linear in blocks and in l_in), and how a
    decode step slows down with the sessions the server runs at once (`load_factor`)."""

    prefill_a_s: float  # seconds per block per prompt token
    prefill_b_s: float  # seconds per block per prompt (fixed part)
    decode_s: float  # seconds per block per generated token, one session alone
    # seconds per block of ONE decode forward of 4 / 16 rows (CONTENTION_ROWS), i.e. 4 / 16 sessions batched
    # together; 0 = not measured (the paper's model: step time independent of load)
    decode_4rows_s: float = 0.0
    decode_16rows_s: float = 0.0

    def __post_init__(self) -> None:
        check_nonneg("ComputeProfile", prefill_a_s=self.prefill_a_s, prefill_b_s=self.prefill_b_s,
                      decode_s=self.decode_s, decode_4rows_s=self.decode_4rows_s,
                      decode_16rows_s=self.decode_16rows_s)
        if (self.decode_4rows_s > 0) != (self.decode_16rows_s > 0):
            raise ValueError("ComputeProfile: decode_4rows_s and decode_16rows_s are measured together (both > 0 or "
                             f"both 0), got {self.decode_4rows_s} and {self.decode_16rows_s}")

    def prefill_s(self, l_in: int) -> float:
        """Seconds to run one block over a prompt of `l_in` tokens."""
        return self.prefill_a_s * l_in + self.prefill_b_s

    def prefill_step_terms(self, blocks: int, rows: int) -> tuple[float, float]:
        """A prefill step of `rows` sequences over `blocks` blocks: (seconds per new token, fixed seconds per step)."""
        return self.prefill_a_s * rows * blocks, self.prefill_b_s * blocks

    def extend_s(self, n_tokens: int) -> float:
        """Seconds of one block for a step of `tokens` new tokens of one sequence past its cache (a decode step,
        a speculative pass, a later prefill chunk): the first at the decode cost, each further one at the prompt's
        marginal cost (a_j)."""
        return self.decode_s + self.prefill_a_s * (n_tokens - 1)

    def step_s(self, blocks: int, rows: int, n_tokens: int, cached: bool) -> float:
        """One step of `rows` sequences x `tokens` new tokens over `blocks` blocks, alone (rows unbatched: a
        bound): a prompt from scratch (not `cached`) at the prefill cost (a * rows * tokens + b per block), any
        step past the tokens a cache holds at `extend_s` per row and block."""
        if not cached:
            per_token, fixed = self.prefill_step_terms(blocks, rows)
            return per_token * n_tokens + fixed
        return self.extend_s(n_tokens) * rows * blocks

    @property
    def contended(self) -> bool:
        """True if step times grow with the sessions the server runs (f is not 1 everywhere)."""
        return self.decode_s > 0 and self.decode_4rows_s > 0

    def load_factor(self, sessions: int) -> float:
        """f(b): a step's compute with `sessions` (b) running at once over one session's alone, f(1) = 1.

        Piecewise linear through (1, 1), (4, f4), (16, f16), the measured cost of one forward of that many rows
        over one row (the sessions' steps batched; sessions out of lockstep wait for each other's rounds on top,
        which this leaves out), extended past 16 with the last segment's slope. Clamped so that noise in the
        measurement cannot make more sessions cheaper (f non-decreasing) or worse than no batching (f(b) <= b).
        """
        if sessions <= 1 or not self.contended:
            return 1.0
        (r1, r2) = CONTENTION_ROWS
        f1 = min(max(self.decode_4rows_s / self.decode_s, 1.0), float(r1))
        f2 = min(max(self.decode_16rows_s / self.decode_s, f1), float(r2))
        if sessions <= r1:
            return 1.0 + (f1 - 1.0) * (sessions - 1) / (r1 - 1)
        return min(f1 + (f2 - f1) * (sessions - r1) / (r2 - r1), float(sessions))

    @classmethod
    def no_batching(cls, prefill_a_s: float, prefill_b_s: float, decode_s: float) -> "ComputeProfile":
        """A profile whose sessions share the compute without any batching gain: f(b) = b."""
        r1, r2 = CONTENTION_ROWS
        return cls(prefill_a_s, prefill_b_s, decode_s, r1 * decode_s, r2 * decode_s)
