"""How many tokens to draft per pass through the swarm: the draft length k that maximizes expected tokens per second.

A speculative pass sends the last accepted token and k drafted tokens as one step of k + 1 tokens and gets the
model's logits for every position: it yields the drafts the model accepts plus one token of its own (the
correction at the first rejection, or the bonus after all k). With each draft accepted with probability a,
independently (Leviathan et al. 2023, "Fast inference from transformers via speculative decoding"):

    tokens per pass(k)  E(k) = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)
    time per pass(k)    T(k) = pass_s(k + 1) + k * draft_s      (the route: RTTs + compute of k + 1 tokens; drafting)
    k*                  argmax over 0 <= k <= k_max of E(k) / T(k)

k = 0 is plain decoding (one token per pass): where a pass costs mostly compute (one fast link, slow servers) or a
is low, k* = 0 and speculation costs nothing. `pass_s` comes from the performance model the planner and the router
use (`PerfModel.pass_s`), `a` from the session's own passes (`AcceptanceEstimate`), one estimate per kind of evidence
behind a draft (`AcceptanceByMatch`: prompt lookup's drafts after a 3-token match are accepted far more often than
after a 1-token one, and a single rate averaged over both would draft too little after the first, too much after
the second).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Union

MAX_DRAFT_TOKENS = 16  # the most drafts one pass may carry (k_max's upper bound)
SpeculativeMode = Union[str, int]  # "auto": k from the rule per pass, "off": plain decoding, an int: that fixed k


def parse_mode(mode: SpeculativeMode) -> int | None:
    """"off" -> 0, "auto" -> None (the rule), an int (or its text) -> that fixed draft length."""
    if mode in ("auto", None):
        return None
    if mode == "off":
        return 0
    try:
        k = int(mode)
    except (TypeError, ValueError):
        raise ValueError(f"speculative must be 'auto', 'off' or a draft length, got {mode!r}") from None
    if not 0 <= k <= MAX_DRAFT_TOKENS:
        raise ValueError(f"a fixed draft length must be in [0, {MAX_DRAFT_TOKENS}], got {k}")
    return k


OUTLIER = 4.0  # a pass slower than this many times its corrected price is not learned from


def expected_tokens(acceptance: float, k: int) -> float:
    """E(k): tokens one pass with k drafts yields, each draft accepted with probability `acceptance`."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def choose_draft_length(acceptance: float, pass_s: Callable[[int], float], k_max: int, draft_s: float = 0.0) -> int:
    """k* = argmax_k E(k) / (pass_s(k + 1) + k draft_s) over 0..k_max; the smallest k among equals (fewer tokens
    sent, less cache to roll back). `pass_s(tokens)`: seconds of one pass of that many tokens through the route."""
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
    if not 0 <= k_max <= MAX_DRAFT_TOKENS or draft_s < 0:
        raise ValueError(f"need 0 <= k_max <= {MAX_DRAFT_TOKENS} and draft_s >= 0, got {k_max} and {draft_s}")
    best_k, best_rate = 0, -math.inf
    for k in range(k_max + 1):
        seconds = pass_s(k + 1) + k * draft_s
        if not seconds > 0:
            raise ValueError(f"pass_s({k + 1}) + {k} * draft_s must be > 0, got {seconds}")
        rate = expected_tokens(acceptance, k) / seconds
        if rate > best_rate * (1 + 1e-9):
            best_k, best_rate = k, rate
    return best_k


@dataclass
class AcceptanceEstimate:
    """A session's running estimate of the per-draft acceptance probability a.

    A pass that proposed k drafts and had n accepted observed n acceptances and, if n < k, one rejection (the
    drafts after it were never tried): a = accepted / tried is the maximum-likelihood estimate under the model
    above. Counts decay by `decay` per pass, drafted or not, so the estimate follows the text (a quote, then free
    prose) and drifts back to the prior while no drafts are tried: a session that chose k = 0 tries again later.
    """

    prior: float = 0.5  # a before any pass
    prior_weight: float = 2.0  # the prior counts as this many tried drafts
    decay: float = 0.9  # per pass: the estimate remembers ~1 / (1 - decay) passes
    accepted: float = 0.0  # decayed counts
    tried: float = 0.0
    passes: int = 0  # undecayed totals, for reports
    drafted: int = 0
    accepted_total: int = 0

    def __post_init__(self) -> None:
        if not (0.0 <= self.prior <= 1.0 and self.prior_weight > 0 and 0.0 < self.decay <= 1.0):
            raise ValueError(f"need prior in [0, 1], prior_weight > 0 and decay in (0, 1], got {self.prior}, "
                             f"{self.prior_weight} and {self.decay}")

    @property
    def rate(self) -> float:
        return (self.accepted + self.prior * self.prior_weight) / (self.tried + self.prior_weight)

    def update(self, proposed: int, accepted: int) -> None:
        """One pass: `proposed` drafts sent, the first `accepted` of them accepted."""
        if not 0 <= accepted <= proposed:
            raise ValueError(f"need 0 <= accepted <= proposed, got {accepted} of {proposed}")
        self.forget()
        self.accepted += accepted
        self.tried += accepted + (1 if accepted < proposed else 0)
        self.passes += 1
        self.drafted += proposed
        self.accepted_total += accepted

    def forget(self) -> None:
        """One pass's decay of the counts, towards the prior."""
        self.accepted *= self.decay
        self.tried *= self.decay


@dataclass
class AcceptanceByMatch:
    """A session's acceptance estimates, one per kind of evidence behind a draft: for prompt lookup the length n of
    the suffix it matched (client/decoding/drafting.py), for a draft model a single key. Every pass decays them all, so a
    kind of draft the rule stopped sending is tried again later."""

    estimates: dict[int, AcceptanceEstimate] = field(default_factory=dict)

    def rate(self, key: int) -> float:
        return self._estimate(key).rate

    def update(self, key: int | None, proposed: int, accepted: int) -> None:
        """One pass: `proposed` drafts of kind `key` sent (None: no draft), the first `accepted` of them accepted."""
        if key is None and proposed:
            raise ValueError(f"{proposed} drafts sent without a kind")
        for other, estimate in self.estimates.items():
            if other != key:
                estimate.forget()
        if key is not None:
            self._estimate(key).update(proposed, accepted)

    def _estimate(self, key: int) -> AcceptanceEstimate:
        if key not in self.estimates:
            self.estimates[key] = AcceptanceEstimate()
        return self.estimates[key]


@dataclass
class MeasuredPassCost:
    """The performance model's price of a pass, corrected by the session's own passes.

    The model prices a pass of n tokens as the route's round trips plus compute whose every further position costs
    the prompt's marginal per-token cost. Measured, a pass of 2 tokens costs more than that over 1 token, and
    further positions about what the model says (SmolLM2, one process: 61 ms for 1 token, 98 for 2, 90 for 4, 113
    for 7; docs/RESULTS-speculation.md): going wide has a fixed price of its own (a server's step leaves the
    decode path, the client's head runs over several positions). Priced without it, a 1-token draft accepted ~15 %
    of the time looks like a small gain where it is about even. So:

        price(n) = scale * model(n) + wide_s * [n > 1]

    `scale`: measured / predicted seconds of the session's one-token passes (the route as it runs: load, the
    client's own work); `wide_s`: what a pass of n > 1 tokens took beyond scale * model(n), never below 0. Both are
    decayed running means, starting at 1 and 0 (the model as it is).
    """

    decay: float = 0.8  # per observation: ~5 passes of memory
    scale: float = 1.0
    wide_s: float = 0.0
    plain_passes: int = 0
    wide_passes: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {self.decay}")

    def observe(self, n_tokens: int, predicted_s: float, measured_s: float) -> None:
        """One pass of `n_tokens` tokens: the model's price of it (uncorrected) and its measured wall time."""
        if n_tokens < 1 or not predicted_s > 0 or measured_s < 0:
            raise ValueError(f"need n_tokens >= 1, predicted_s > 0 and measured_s >= 0, got {n_tokens}, {predicted_s}, "
                             f"{measured_s}")
        if self.plain_passes and measured_s > OUTLIER * self.scale * predicted_s:
            return  # a failover's or a stalled pass says nothing about the next one
        if n_tokens == 1:
            self.scale = self._mean(self.scale, measured_s / predicted_s, self.plain_passes)
            self.plain_passes += 1
        else:
            self.wide_s = self._mean(self.wide_s, max(0.0, measured_s - self.scale * predicted_s), self.wide_passes)
            self.wide_passes += 1

    def corrected(self, model: Callable[[int], float]) -> Callable[[int], float]:
        """tokens -> the corrected price of a pass, from the model's `model(tokens)`."""
        return lambda n_tokens: self.scale * model(n_tokens) + (self.wide_s if n_tokens > 1 else 0.0)

    def _mean(self, mean: float, value: float, seen: int) -> float:
        return value if not seen else self.decay * mean + (1 - self.decay) * value
