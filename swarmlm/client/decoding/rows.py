"""The rows of a speculative session (client/decoding/decoder.py) and the pure bookkeeping of one pass.

A session holds one length for all its rows (`CacheOp.truncate_to` cuts every row at once), but the rows of a batch
accept different numbers of drafts. So a pass sends row r its `head` (the tokens the servers do not hold yet) and
its drafts, right-padded to the widest row (`padded_step`); row r then keeps kept_r = len(head_r) + accepted_r
positions of the step, and the servers keep the fewest of them in every row (`common_cut`). The kept region holds
real tokens only (every row's real tokens come first in its step), and row r's kept_r - min kept_r tokens are
owed: they lead its next step again, and count against its drafts (a row sends at most 1 + k_max tokens), so a
row ahead of the batch's slowest waits for it: it never owes more than k_max tokens, and the backlog of resent
tokens cannot grow (without that cap a fast row's debt grows by a_r - a_min every pass). Nothing in a cache is ever
wrong. With one row, kept = the step's accepted part and nothing is owed.

    row r     text  = prompt + chosen tokens (the newest not sent yet); sent = how many of them the servers hold
    step      [text[sent:], d_1..d_k, pad...]  mask [1..1, 0..0]
    after     sent += min_r kept_r  (for every row)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from swarmlm.perf.speculation import AcceptanceByMatch


@dataclass
class Row:
    """One sequence of a speculative session: its text, what the servers hold of it, how it chooses and drafts."""

    text: list[int]  # the prompt's real tokens and every token chosen since; the newest (last) is not sent yet
    sent: int  # tokens of `text` the servers hold (after the cut the next step carries)
    processors: object  # transformers' LogitsProcessorList, scoring a position given the tokens before it
    generator: torch.Generator | None  # for sampling (None: torch's global one)
    drafter: object  # PromptLookup (stateless, may be shared) or this row's own DraftModel
    stats: object  # SpeculationStats of this row's passes
    estimate: AcceptanceByMatch = field(default_factory=AcceptanceByMatch)  # per kind of draft
    draft_s_per_token: float = 0.0  # measured, a draft model's; prompt lookup costs ~nothing
    kept: int = 0  # positions of the last step the row keeps: its head + the drafts it accepted

    @property
    def head(self) -> list[int]:
        """What the row's next step sends first: tokens it owes the servers, then the newest."""
        return self.text[self.sent:]


def padded_step(steps: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's tokens, right-padded to the widest: ids [B, W] and mask [B, W] (1 = real, 0 = pad; None when no
    row is padded). A pad repeats the row's last token: any id of the vocabulary would do, it is masked."""
    if not steps or any(not s for s in steps):
        raise ValueError("every row of a step needs at least one token")
    width = max(len(s) for s in steps)
    ids = torch.tensor([list(s) + [s[-1]] * (width - len(s)) for s in steps], dtype=torch.long)
    if all(len(s) == width for s in steps):
        return ids, None
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in steps], dtype=torch.long)
    return ids, mask


def draft_limit(k_max: int, head: int, room: int, free: int) -> int:
    """Drafts a row may send after its `head` tokens: k_max less what it owes (a step of at most 1 + k_max tokens),
    none past the `room` new tokens it may still generate, nor past the session's `free` positions."""
    return min(k_max + 1 - head, room - 1, free - head)


def common_cut(kept: Sequence[int], width: int) -> int:
    """Positions of a step `width` wide that the servers keep in every row: the fewest any row keeps."""
    if not kept or not all(1 <= k <= width for k in kept):
        raise ValueError(f"each row keeps 1 to {width} positions of the step, got {list(kept)}")
    return min(kept)


def is_left_padded(mask: torch.Tensor) -> bool:
    """A [B, T] 0/1 mask whose rows are zeros then ones, at least one: prompts padded on the left (generate()'s)."""
    return bool((mask[:, -1] == 1).all() and (mask[:, 1:] >= mask[:, :-1]).all())


def real_tokens(ids: torch.Tensor, mask: torch.Tensor | None) -> list[list[int]]:
    """Each row's tokens without its left padding: ids [B, T], mask [B, T] or None (no padding)."""
    if mask is None:
        return ids.tolist()
    if mask.shape != ids.shape or not is_left_padded(mask):
        raise ValueError(f"expected a left-padding mask {list(ids.shape)}, got {list(mask.shape)} or a row with a "
                         "hole or right padding")
    return [row[m.bool()].tolist() for row, m in zip(ids, mask)]
