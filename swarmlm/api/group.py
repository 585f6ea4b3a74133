"""The n choices of one prompt (the API's `n`) in one session: the prompt's step runs once, for one row; the servers
copy its cache to n rows with the next step (a CacheOp, no extra round trip), and every step then advances the rows
still running, each choosing its tokens with its own processors and generator (api/engine.py ChoiceDecoder). A
choice that ends leaves the session with the next step (CacheOp rows = the others), so the servers stop computing
and holding it. With `speculative`, the rows speculate (client/speculative.py, one row per choice): each pass gives
every choice 1 to k + 1 tokens.

    rows      live[i] = the choice in the session's row i
    step 1    prompt [1, L] -> logits [1, V], shared by all n choices; pending op: rows (0,) * n
    step t    last token of each live row [B, 1], op (copies, drops) -> logits [B, V]
              (speculating: each row's head and drafts, right-padded [B, W] -> its tokens)
"""
from __future__ import annotations

import threading
from typing import Sequence

import torch

from swarmlm.client.remote_cache import RemoteCache
from swarmlm.client.speculative import SpeculativeDecoder, SpeculativeMode, parse_mode
from swarmlm.types import CacheOp, Span


class ChoiceGroup:
    """n choices sharing one session, stepped together from one worker thread."""

    def __init__(self, model, prompt_ids: Sequence[int], choices: list, speculative: SpeculativeMode = "off") -> None:
        if not choices:
            raise ValueError("a group needs at least one choice")
        self.model = model
        self.prompt = torch.tensor([list(prompt_ids)], dtype=torch.long)  # [1, L]
        self.choices = choices  # ChoiceDecoders (used for their processors, generator and text; no session)
        self.live: list[int] = list(range(len(choices)))  # session row -> choice
        self.session = None
        self.pending: CacheOp | None = None  # the edit the next step carries
        self.speculative = speculative if parse_mode(speculative) != 0 else None
        self.speculator: SpeculativeDecoder | None = None  # with `speculative`: row i = choice i
        self.lock = threading.Lock()  # a close waits for the step in flight
        self.closed = False

    @torch.no_grad()
    def step(self) -> dict[int, list]:
        """The next tokens of every live choice: {choice: [Token]} (one each, or a speculative pass's)."""
        with self.lock:
            if self.closed:
                raise RuntimeError("this group was closed")
            if self.session is None:
                longest = max(c.params.max_tokens for c in self.choices)
                self.session = self.model.inference_session(
                    max_length=self.prompt.shape[1] + longest, batch_size=len(self.choices),
                    l_in_hint=self.prompt.shape[1], l_out_hint=longest,
                    prefix_scope=self.choices[0].params.prefix_scope).open()
                if self.speculative is not None:
                    return self._speculate()
                logits = self.model.step_logits(self.session, self.prompt, None, last_only=True)[:, -1].float()
                self._edit(CacheOp(rows=(0,) * len(self.live)))  # every choice continues the prompt's cache
                logits = logits.repeat(len(self.live), 1)  # [B, V], a row each (processors may write in place)
            elif self.speculator is not None:
                return self._speculate()
            else:
                ids = torch.cat([self.choices[c].ids[:, -1:] for c in self.live])  # [B, 1]
                op, self.pending = self.pending, None
                logits = self.model.step_logits(self.session, ids, None, last_only=True, op=op)[:, -1].float()
            return {c: [self.choices[c].accept(logits[row:row + 1])] for row, c in enumerate(self.live)}

    def _speculate(self) -> dict[int, list]:
        """The prompt's step (its cache copied to a row per choice), or one pass for every live choice."""
        if self.speculator is None:
            first = self.choices[0]
            self.speculator = SpeculativeDecoder(
                self.model, RemoteCache(self.model, self.session), [c.processors for c in self.choices],
                not first.params.greedy, self.speculative, generator=[c.generator for c in self.choices])
            passed = self.speculator.start_rows(self.prompt, copies=len(self.choices))
        else:
            passed = self.speculator.advance_rows({c: self.choices[c].room for c in self.live})
        return {c: self.choices[c].take_pass(*passed[c]) for c in self.live}

    def drop(self, choice: int) -> None:
        """The choice has ended: its row leaves the session with the next step."""
        row = self.live.index(choice)
        self.live.pop(row)
        if self.speculator is not None:
            self.speculator.drop(choice)
        elif self.live:
            self._edit(CacheOp(rows=tuple(r for r in range(len(self.live) + 1) if r != row)))

    def route(self) -> tuple[Span, ...]:
        return tuple(self.session.route_spans()) if self.session is not None else ()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            if self.session is not None:
                self.session.close()

    def _edit(self, op: CacheOp) -> None:
        self.pending = op if self.pending is None else self.pending.then(op)
