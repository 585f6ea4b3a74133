"""How many tokens a decoder drafts per pass, and what its passes did (client/decoding/decoder.py).

k is chosen before each pass: fixed by the caller (`speculative=K`; 0 is plain decoding, one token a step), or in
"auto" from the rows' acceptance estimate and the route's measured pass cost (perf/speculation.py). Prompt lookup
drafts first (free) and sizes k by the match it found; a draft model costs time per token, so k is chosen before
it drafts.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from swarmlm.client.decoding.drafting import PromptLookup
from swarmlm.perf.speculation import MAX_DRAFT_TOKENS, SpeculativeMode, choose_draft_length, parse_mode

DEFAULT_MAX_DRAFT = 8  # k_max for "auto"
DRAFT_MODEL_KIND = 0  # a draft model's drafts in the acceptance estimate (prompt lookup's: the match length, >= 1)
PROMPT_LOOKUP = PromptLookup()  # stateless: every row drafts with it


@dataclass
class SpeculationStats:
    """What speculation did in one generate() call (GenerationStats.speculation)."""

    passes: int = 0  # steps through the route after the prompt's
    drafted: int = 0  # draft tokens sent
    accepted: int = 0  # of them kept
    n_tokens: int = 0  # tokens the passes yielded
    draft_s: float = 0.0  # client time spent drafting
    draft_lengths: list[int] = field(default_factory=list)  # k sent per pass
    by_kind: dict[int, list[int]] = field(default_factory=dict)  # draft kind -> [drafted, accepted]
    resent: int = 0  # accepted tokens sent again: past what every row of the batch kept (rows.py)
    rows: list["SpeculationStats"] = field(default_factory=list)  # a batch's: each row's own

    @classmethod
    def of_rows(cls, rows: list["SpeculationStats"], passes: int) -> "SpeculationStats":
        """A batch's: every row's counts summed, `passes` the trips (tokens_per_pass: the batch's tokens per trip)."""
        total = cls(passes=passes, rows=list(rows))
        for row in rows:
            total.drafted += row.drafted
            total.accepted += row.accepted
            total.n_tokens += row.n_tokens
            total.draft_s += row.draft_s
            total.resent += row.resent
            total.draft_lengths += row.draft_lengths
            for kind, (drafted, accepted) in row.by_kind.items():
                counts = total.by_kind.setdefault(kind, [0, 0])
                counts[0] += drafted
                counts[1] += accepted
        return total

    def record(self, kind: int | None, drafted: int, accepted: int) -> None:
        self.passes += 1
        self.drafted += drafted
        self.accepted += accepted
        self.n_tokens += accepted + 1
        self.draft_lengths.append(drafted)
        if drafted:
            counts = self.by_kind.setdefault(kind, [0, 0])
            counts[0] += drafted
            counts[1] += accepted

    @property
    def tokens_per_pass(self) -> float:
        return self.n_tokens / self.passes if self.passes else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def to_dict(self) -> dict:
        return {"passes": self.passes, "drafted": self.drafted, "accepted": self.accepted, "tokens": self.n_tokens,
                "tokens_per_pass": self.tokens_per_pass, "acceptance_rate": self.acceptance_rate,
                "mean_k": sum(self.draft_lengths) / len(self.draft_lengths) if self.draft_lengths else 0.0,
                "by_kind": {str(kind): counts for kind, counts in sorted(self.by_kind.items())},
                "resent": self.resent, **({"rows": [row.to_dict() for row in self.rows]} if self.rows else {})}


class DraftPolicy:
    """The drafts of a pass for the running rows: `fixed_k` (None: the rule) at most `k_max` tokens each."""

    def __init__(self, mode: SpeculativeMode, k_max: int, do_sample: bool) -> None:
        self.fixed_k = parse_mode(mode)
        self.k_max = min(k_max, MAX_DRAFT_TOKENS) if self.fixed_k is None else self.fixed_k
        self.do_sample = do_sample

    def draft_rows(self, rows: list, limits: list[int], cost, pick) -> list[tuple[list[int], list | None, int | None]]:
        """Every running row's drafts (at most limits[i] for the i-th): (drafts, their distributions q or None for
        one-hot / greedy, their kind for the acceptance estimate). `pick(row, logits)`: a draft model's token.

        In "auto" the rows draft as one: the servers keep the fewest positions any row keeps, so a row's drafts
        accepted past the slowest row's are sent again on every later pass until that row catches up (in open-ended
        text, rarely): a batch moves at its slowest row's pace. k is chosen once, with the lowest of the rows'
        acceptance estimates."""
        if max(limits, default=0) <= 0:
            return [([], None, None) for _ in rows]  # plain decoding, or no room left: nothing to draft
        t0 = time.perf_counter()
        if isinstance(rows[0].drafter, PromptLookup):
            found = [row.drafter.lookup(torch.tensor(row.text), limit) if limit > 0 else ([], 0)
                     for row, limit in zip(rows, limits)]
            rate = min(row.estimate.rate(n) if drafts else 0.0 for row, (drafts, n) in zip(rows, found))
            k = self.draft_length(rate, max(len(d) for d, _ in found), cost)
            for row in rows:
                row.stats.draft_s += (time.perf_counter() - t0) / len(rows)
            return [(drafts[:k], None, n) if k and drafts else ([], None, None) for drafts, n in found]
        rate = min(row.estimate.rate(DRAFT_MODEL_KIND) for row in rows)
        k = self.draft_length(rate, max(limits), cost, sum(row.draft_s_per_token for row in rows))
        return [self.model_drafts(row, min(k, limit), pick) for row, limit in zip(rows, limits)]

    def draft_length(self, rate: float, limit: int, cost, draft_s: float = 0.0) -> int:
        """The draft length for a pass: the caller's fixed k, or the rule's (0 where no draft is likely)."""
        if limit <= 0:
            return 0
        if self.fixed_k is not None:
            return min(self.fixed_k, limit)
        return choose_draft_length(rate, cost(), limit, draft_s) if rate > 0 else 0

    def model_drafts(self, row, k: int, pick) -> tuple[list[int], list | None, int | None]:
        """k drafts from the row's draft model (measuring what a draft token costs)."""
        if k <= 0:
            return [], None, None
        t0 = time.perf_counter()
        drafts, q = row.drafter.draft(torch.tensor(row.text), k, lambda logits: pick(row, logits))
        elapsed = time.perf_counter() - t0
        row.draft_s_per_token = elapsed / k if not row.draft_s_per_token else \
            0.8 * row.draft_s_per_token + 0.2 * elapsed / k
        row.stats.draft_s += elapsed
        return drafts, q if self.do_sample else None, DRAFT_MODEL_KIND
