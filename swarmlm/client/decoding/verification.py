"""Which drafted tokens a speculative pass keeps, so that the output is the model's own.

A pass gives the model's next-token scores at k + 1 positions: after the last accepted token and after each of the
k drafts. Both rules return the tokens the pass yields: the accepted drafts, then one token of the model's own (at
the first rejection its correction, after k accepted drafts a bonus token), so 1 to k + 1 tokens.

* Greedy: a draft is accepted while it is the model's argmax; the result is exactly greedy decoding's.
* Sampling, the standard rejection rule (Leviathan et al. 2023; Chen et al. 2023): draft d_i drawn from q_i is
  accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the token is drawn from
  max(0, p_i - q_i), normalized. Each output token is then distributed as p_i, the model's own distribution
  (after its logits processors: temperature, top-k/p...). A deterministic drafter (prompt lookup) has a one-hot
  q_i: accept with probability p_i(d_i), else draw from p_i without d_i.
"""
from __future__ import annotations

from typing import Sequence

import torch


def verify_greedy(drafts: Sequence[int], scores: torch.Tensor) -> list[int]:
    """scores: [k + 1, V] the model's scores (logits or probabilities) at each position."""
    _check(drafts, scores)
    best = scores.argmax(dim=-1).tolist()
    out: list[int] = []
    for i, d in enumerate(drafts):
        if d != best[i]:
            break
        out.append(d)
    out.append(best[len(out)])
    return out


def verify_sampling(drafts: Sequence[int], p: torch.Tensor, q: Sequence[torch.Tensor | None] | None,
                    generator: torch.Generator | None = None) -> list[int]:
    """p: [k + 1, V] the model's probabilities; q[i]: [V] the distribution draft i was drawn from (None: one-hot,
    a deterministic draft)."""
    _check(drafts, p)
    if q is not None and len(q) != len(drafts):
        raise ValueError(f"{len(drafts)} drafts but {len(q)} draft distributions")
    out: list[int] = []
    for i, d in enumerate(drafts):
        q_i = None if q is None else q[i]
        p_d = float(p[i, d])
        q_d = 1.0 if q_i is None else float(q_i[d])
        if q_d > 0 and _uniform(generator) * q_d < p_d:  # u < p/q, without dividing by a tiny q
            out.append(d)
            continue
        residual = p[i].clone()
        if q_i is None:
            residual[d] = 0.0
        else:
            residual = (residual - q_i.to(residual.dtype)).clamp_min(0.0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: any draw from p is right
            residual = p[i]
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[len(drafts)], 1, generator=generator)))
    return out


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def _check(drafts: Sequence[int], scores: torch.Tensor) -> None:
    if scores.dim() != 2 or scores.shape[0] != len(drafts) + 1:
        raise ValueError(f"expected scores [{len(drafts) + 1}, V] for {len(drafts)} drafts, got {list(scores.shape)}")
