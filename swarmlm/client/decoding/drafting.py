"""Drafts for speculative decoding: tokens guessed cheaply on the client, for the swarm to verify in one pass.

* `PromptLookup`: the text so far often repeats itself (a quoted input, a list being continued, code being edited):
  find the latest earlier occurrence of the context's last n tokens and propose what followed it. Free, and
  deterministic, so its draft distribution q is one-hot (client/decoding/verification.py).
* `DraftModel`: a small local causal LM of the same tokenizer guesses the next k tokens, greedily or by sampling
  (then its probabilities q go with the drafts). Its own cache follows the accepted text: every call first drops
  what the last verification rejected.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class PromptLookup:
    """N-gram match in the context: the longest suffix of `max_ngram` .. `min_ngram` tokens found earlier."""

    max_ngram: int = 3  # longer matches predict better; shorter ones match more often
    min_ngram: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram ({self.min_ngram}) <= max_ngram ({self.max_ngram})")

    def draft(self, ids: torch.Tensor, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the context's last n tokens (longest n
        first); [] when nothing matches. ids: [T] token ids, the prompt and what was generated so far."""
        return self.lookup(ids, k)[0]

    def lookup(self, ids: torch.Tensor, k: int) -> tuple[list[int], int]:
        """(draft, n): the draft as in `draft` and the length n of the suffix it matched (0: no match). A longer
        match predicts better: a 3-token match inside a quoted text is usually followed by more of the quote, a
        single common token ("the", ",") rarely, so the speculative decoder keeps an acceptance estimate per n."""
        if ids.dim() != 1:
            raise ValueError(f"expected token ids [T], got shape {list(ids.shape)}")
        total = ids.shape[0]
        if k <= 0:
            return [], 0
        for n in range(min(self.max_ngram, total - 1), self.min_ngram - 1, -1):
            suffix = ids[total - n:]
            windows = ids[:total - 1].unfold(0, n, 1)  # [T - n, n]: every n-gram that has a token after it
            hits = torch.nonzero((windows == suffix).all(dim=1)).flatten() + n  # where each continuation starts
            if hits.numel():
                # the latest occurrence (nearest text predicts best) that has k tokens after it, else the earliest:
                # in a repeating tail the latest match's continuation runs into the end of the context
                full = hits[hits + k <= total]
                start = int(full[-1]) if full.numel() else int(hits[0])
                return ids[start:start + k].tolist(), n
        return [], 0


class DraftModel:
    """A small local causal LM (transformers) that drafts for the swarm's model: same tokenizer, its own cache.

    `pick(logits [V]) -> (token, probs [V] | None)` turns its next-token logits into a draft: argmax for greedy
    decoding (probs None), or a sample with the probabilities it was drawn from, for the rejection rule.
    """

    def __init__(self, model) -> None:
        from transformers import DynamicCache

        self.model = model.eval()
        self.cache = DynamicCache(config=model.config)
        self.tokens: list[int] = []  # the tokens the cache holds, in order

    @staticmethod
    def greedy(logits: torch.Tensor) -> tuple[int, None]:
        return int(logits.argmax()), None

    @torch.no_grad()
    def draft(self, ids: torch.Tensor, k: int,
              pick: Callable[[torch.Tensor], tuple[int, torch.Tensor | None]] = greedy) -> tuple[list[int], list]:
        """k draft tokens after ids [T], and the probabilities each was drawn from (None for greedy)."""
        if ids.dim() != 1 or ids.shape[0] == 0:
            raise ValueError(f"expected token ids [T > 0], got shape {list(ids.shape)}")
        context = ids.tolist()
        keep = _common_prefix(self.tokens, context)
        keep = min(keep, len(context) - 1)  # at least one token goes in: its logits give the first draft
        if keep < len(self.tokens):
            self.cache.crop(keep - len(self.tokens))  # transformers 5: a negative count of tokens to drop
            del self.tokens[keep:]
        tokens, probs = [], []
        new = context[keep:]
        for _ in range(k):
            logits = self._forward(new)
            token, p = pick(logits)
            tokens.append(token)
            probs.append(p)
            new = [token]
        return tokens, probs

    def _forward(self, new: list[int]) -> torch.Tensor:
        out = self.model(input_ids=torch.tensor([new]), cache=self.cache, use_cache=True)
        self.tokens += new
        return out.logits[0, -1].float()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
