"""The one decoder: the rows of one swarm session, choosing their tokens one step or one speculative pass at a time.

generate(speculative=...), the gateway's choices and the gateway's `n` all run here (transformers' own generate()
keeps RemoteCache for beams and assisted decoding). A decoder owns its session through a RemoteCache (the one
pending cache operation every step carries), and decides once:
  - the session's length (`session_length`): prompt + new tokens + one pass's drafts, within the context;
  - the prefix cache: one unpadded prompt starts from a prefix the servers hold, its n copies too (model.forward's
    rule; the session opens from it and the prompt's step carries what the prefix leaves);
  - rows: `copies` of each prompt (the prompt's cache copied with the next step), a row that ended leaves with
    the next step (`drop`).

Every pass sends each row's newest token plus k drafted ones (drafts.py; k = 0 is plain decoding) as ONE step, so
the servers return the model's scores at every position; the client keeps the verified prefix plus one token of the
model's own (verification.py) and tells the servers to drop the rejected drafts with the next step.

    text      a row's tokens: the prompt's and every one chosen since; the newest is chosen, not sent yet
    head      what the row's next step sends first: text[sent:] (tokens it owes the servers, then the newest)
    pass      step [head, d_1..d_k] -> scores [k + 1, V] at head[-1], d_1..d_k -> tokens t_1..t_{n+1}
              (n drafts accepted); the row keeps len(head) + n positions of the step; text += t_1..t_{n+1}

A batch holds one length for all rows, and rows accept different numbers of drafts: each row's step is right-padded
to the widest, and the servers keep, in every row, the fewest positions any row keeps (rows.py); a row's accepted
tokens past it are owed, sent again first in its next step. With one row nothing is ever owed.

Greedy output is exactly plain greedy decoding's; sampled output follows the model's own distribution (a pass
without drafts draws as transformers does: softmax, then one multinomial draw from the row's generator).
"""
from __future__ import annotations

import functools
import time
from typing import Sequence

import torch

from swarmlm.client.decoding.drafting import DraftModel
from swarmlm.client.decoding.drafts import (DEFAULT_MAX_DRAFT, PROMPT_LOOKUP, DraftPolicy, SpeculationStats,
                                            SpeculativeMode, parse_mode)
from swarmlm.client.decoding.rows import Row, common_cut, draft_limit, padded_step, real_tokens
from swarmlm.client.decoding.sampling import Sampling
from swarmlm.client.decoding.verification import verify_greedy, verify_sampling
from swarmlm.client.remote_cache import RemoteCache
from swarmlm.perf.speculation import MeasuredPassCost
from swarmlm.types import Span

__all__ = ["Decoder", "SpeculationStats", "SpeculativeMode", "parse_mode", "session_length"]


def session_length(prompt_tokens: int, max_new_tokens: int, k_max: int, context: int | None = None) -> int:
    """Positions a decoding session reserves: the prompt, the new tokens but the last (never sent) and one pass's
    drafts (fewer drafts near the end otherwise), within `context` when the caller knows the servers' limit."""
    want = prompt_tokens + max_new_tokens + k_max
    return min(want, context) if context else want


class Decoder:
    """The rows of one session. `start_rows` (the prompts' step), then `advance_rows` / `step` (one pass for every
    running row) until the caller has enough, `drop` a row that ended, `close`; `generate_rows` is that loop.
    `sampling`: one Sampling for every row or a list of one per row (their processors score each position given the
    tokens before it); `generator`: one torch.Generator (or None: torch's global one) or one per row."""

    def __init__(self, model, sampling: Sampling | Sequence[Sampling], mode: SpeculativeMode = "auto",
                 draft_model=None, generator=None, k_max: int = DEFAULT_MAX_DRAFT, session=None, stats=None,
                 context_tokens: int | None = None) -> None:
        self.model = model
        self.cache = RemoteCache(model, session, stats)  # the session, and the edit the next step carries
        self.sampling = sampling
        first = sampling[0] if isinstance(sampling, (list, tuple)) else sampling
        self.cache.prefix_scope = first.prefix_scope
        self.do_sample = first.do_sample  # (the same for every row: verification's rule)
        self.policy = DraftPolicy(mode, k_max, self.do_sample)
        self.draft_model = draft_model
        self.generator = generator
        self.context_tokens = context_tokens  # the servers' limit on a session's length, when known
        self.rows: list[Row] = []  # every row, in the order the caller numbers them
        self.live: list[int] = []  # rows still running, in their session order after the next step's edit
        self.new: list[int] = []  # new tokens each row has chosen
        self._source: dict[int, int] = {}  # running row -> the session row that holds its cache now
        self._written = 0  # width of the last pass's step (0: the next step carries no cut)
        self.passes = 0  # trips through the route after the prompts' step
        self.measured = MeasuredPassCost()  # the model's pass price, corrected by this session's passes
        self.closed = False

    @property
    def k_max(self) -> int:
        return self.policy.k_max

    @property
    def stats(self) -> SpeculationStats:
        """One row's stats; a batch's: every row's summed, passes = trips (per-row stats under `rows`)."""
        if len(self.rows) <= 1:
            return self.rows[0].stats if self.rows else SpeculationStats()
        return SpeculationStats.of_rows([row.stats for row in self.rows], self.passes)

    # ---- the loop -----------------------------------------------------------------------------------------
    def generate(self, prompt: list[int], max_new_tokens: int, eos: tuple[int, ...] = (),
                 on_tokens=None) -> list[int]:
        """New tokens after `prompt` (at most max_new_tokens, ending at the first eos). on_tokens(list): each pass's."""
        return self.generate_rows(torch.tensor([prompt]), None, max_new_tokens, eos,
                                  on_tokens=on_tokens and (lambda row, tokens: on_tokens(tokens)))[0]

    def generate_rows(self, ids: torch.Tensor, mask: torch.Tensor | None, max_new_tokens: int,
                      eos: tuple[int, ...] = (), copies: int = 1, on_tokens=None,
                      on_logits=None) -> list[list[int]]:
        """New tokens of every row (at most max_new_tokens, ending at the first eos): prompts ids [B, T] (left-padded
        where mask [B, T] is 0), each `copies` times (rows i * copies ...). on_tokens(row, list): each pass's;
        on_logits(row, logits [len(list), V]): the logits each of them was chosen from (before the processors)."""
        passed = self.start_rows(ids, mask, copies, max_new_tokens)
        new: list[list[int]] = [[] for _ in self.rows]
        while True:
            for row, (tokens, logits) in passed.items():
                tokens = _until_eos(tokens[:max_new_tokens - len(new[row])], eos)
                new[row] += tokens
                if on_tokens is not None:
                    on_tokens(row, tokens)
                if on_logits is not None:
                    on_logits(row, logits[:len(tokens)])
                if len(new[row]) >= max_new_tokens or (eos and new[row][-1] in eos):
                    self.drop(row)
            if not self.live:
                return new
            passed = self.advance_rows({row: max_new_tokens - len(new[row]) for row in self.live})

    def start(self, prompt: list[int], max_new_tokens: int | None = None) -> tuple[list[int], torch.Tensor]:
        """One row's prompt step: ([first token], its logits [1, V])."""
        return self.start_rows(torch.tensor([prompt]), max_new_tokens=max_new_tokens)[0]

    def advance(self, room: int) -> tuple[list[int], torch.Tensor]:
        """One row's pass, with drafts for at most `room` - 1 more tokens: (the 1 to k + 1 tokens it yields, the
        logits [len(tokens), V] each was chosen from, before the processors)."""
        return self.advance_rows({0: room})[0]

    def step(self) -> dict[int, tuple[list[int], torch.Tensor]]:
        """One pass for every running row, within each row's own max_new_tokens (its Sampling's)."""
        return self.advance_rows({r: self._sampling_of(r).max_new_tokens - self.new[r] for r in self.live})

    def start_rows(self, ids: torch.Tensor, mask: torch.Tensor | None = None, copies: int = 1,
                   max_new_tokens: int | None = None) -> dict[int, tuple[list[int], torch.Tensor]]:
        """The prompts' step: ids [B, T] (left-padded where mask [B, T] is 0), each prompt continued by `copies` rows
        (its cache copied with the next step). {row: ([first token], its logits [1, V])}. The session (unless
        given) opens here, `session_length` long for max_new_tokens (default: the longest row's Sampling's)."""
        if self.rows:
            raise RuntimeError("start_rows() twice")
        prompts = real_tokens(ids, mask)
        mask = mask if mask is not None and not bool(mask.all()) else None
        one = ids[0] if ids.shape[0] == 1 and mask is None and self.cache.use_prefix else None  # (the prefix rule)
        self._open(int(ids.shape[0]) * copies, int(ids.shape[1]), max_new_tokens, one)
        logits = self.model(input_ids=ids, attention_mask=mask, cache=self.cache, logits_to_keep=1).logits[:, -1]
        out = {}
        for i, prompt in enumerate(prompts):
            for _ in range(copies):
                r = len(self.rows)
                self.rows.append(self._new_row(r, prompt))
                self._source[r] = i
                own = logits[i:i + 1] if copies == 1 else logits[i:i + 1].clone()  # [1, V]: a row's own
                tokens = self._verify(self.rows[r], [], None, own)
                self.rows[r].text += tokens
                out[r] = (tokens, own)
        self.live = list(range(len(self.rows)))
        self.new = [1] * len(self.rows)
        return out

    def advance_rows(self, rooms: dict[int, int]) -> dict[int, tuple[list[int], torch.Tensor]]:
        """One pass for every running row, row r with drafts for at most rooms[r] - 1 more tokens: {row: (the 1 to
        k + 1 tokens it yields, the logits [len(tokens), V] each was chosen from, before the processors)}."""
        if not self.live:
            raise RuntimeError("advance() with no row running (before start(), or after every row ended)")
        self._settle()
        free = self.cache.session.max_length - self.cache.virtual_tokens - self.cache.get_seq_length()
        model_cost = functools.cache(self._pass_cost)  # asked only when drafts are sized by the rule
        cost = lambda: self.measured.corrected(model_cost())  # noqa: E731
        heads = [self.rows[r].head for r in self.live]
        # a row's owed tokens count against its drafts: a row ahead of the batch's slowest waits for it
        limits = [draft_limit(self.k_max, len(head), rooms[r], free) for r, head in zip(self.live, heads)]
        drafted = self.policy.draft_rows([self.rows[r] for r in self.live], limits, cost, self._pick)
        steps = [head + drafts for head, (drafts, _, _) in zip(heads, drafted)]
        ids, mask = padded_step(steps)
        width = ids.shape[1]
        first = width - min(len(head) for head in heads)  # the leftmost logits any row reads: at its newest token
        t0 = time.perf_counter()
        logits = self.model(input_ids=ids, attention_mask=mask, cache=self.cache,
                            logits_to_keep=first + 1).logits  # [B, first + 1, V]
        elapsed = time.perf_counter() - t0
        predicted = model_cost()(width) if self.policy.fixed_k is None else 0.0
        if predicted > 0:  # the rule learns what passes of this width really cost on this route
            self.measured.observe(width, predicted, elapsed)
        out = {}
        for j, (r, head, (drafts, q, kind)) in enumerate(zip(self.live, heads, drafted)):
            row = self.rows[r]
            at = len(head) - 1 - (width - first - 1)  # the row's newest token, in logits' columns
            own = logits[j, at:at + len(drafts) + 1]  # [k + 1, V]
            tokens = self._verify(row, drafts, q, own)
            accepted = len(tokens) - 1
            row.kept = len(head) + accepted
            row.text += tokens
            row.estimate.update(kind if drafts else None, len(drafts), accepted)
            row.stats.record(kind, len(drafts), accepted)
            row.stats.resent += len(head) - 1
            self.new[r] += len(tokens)
            out[r] = (tokens, own[:len(tokens)])
        self.passes += 1
        self._written = width
        return out

    def drop(self, row: int) -> None:
        """Row `row` has ended: it leaves the session with the next step."""
        self.live.remove(row)

    def route(self) -> tuple[Span, ...]:
        """The servers and blocks the session went through (the last ones, after a failover)."""
        return tuple(self.cache.session.route_spans()) if self.cache.session is not None else ()

    def close(self, sequences: torch.Tensor | None = None):
        """Close the session (one this decoder opened; again: nothing more); the GenerationStats of the whole run."""
        if self.closed:
            return self.cache.stats
        self.closed = True
        if self.rows and self.cache.stats.speculation is None:
            self.cache.stats.speculation = self.stats.to_dict()
        return self.cache.finish(sequences)

    # ---- its parts ----------------------------------------------------------------------------------------
    def _open(self, rows: int, width: int, max_new_tokens: int | None, prompt: torch.Tensor | None) -> None:
        """The session-length rule, and the session opened for every copy, from a cached prefix of `prompt` (one
        unpadded prompt) when the servers hold one; one row: model.forward opens it with the prompt."""
        self.cache.stats.prompt_tokens = width
        if self.cache.session is not None:
            return
        if max_new_tokens is None:
            max_new_tokens = max(s.max_new_tokens for s in _as_list(self.sampling, rows))
        self.cache.max_length = session_length(width, max_new_tokens, self.k_max, self.context_tokens)
        if rows > 1:
            self.cache.virtual_tokens = self.model.virtual_tokens  # (a soft prompt's positions: the session's too)
            # a cached prefix was computed without a soft prompt: with one, the session starts empty
            self.cache.session_for(rows, width, None if self.cache.virtual_tokens else prompt)

    def _sampling_of(self, r: int) -> Sampling:
        return _of_row(self.sampling, r)

    def _new_row(self, r: int, prompt: list[int]) -> Row:
        drafter = DraftModel(self.draft_model) if self.draft_model is not None else PROMPT_LOOKUP
        return Row(text=list(prompt), sent=len(prompt), processors=self._sampling_of(r).processors(len(prompt)),
                   generator=_of_row(self.generator, r), drafter=drafter, stats=SpeculationStats())

    def _settle(self) -> None:
        """The edit the next step carries: the running rows cut to the fewest positions of the last step any of
        them keeps (each row's tokens past that lead its next step), and the ended rows left out."""
        if self._written:
            keep = common_cut([self.rows[r].kept for r in self.live], self._written)
            for r in self.live:
                self.rows[r].sent += keep
            if keep < self._written:
                self.cache.crop(keep - self._written)
            self._written = 0
        self.cache.batch_select_indices(torch.tensor([self._source[r] for r in self.live]))
        self._source = {r: i for i, r in enumerate(self.live)}

    def _pass_cost(self):
        """tokens per row -> seconds of one pass of the session's rows (the whole batch's tokens travel together)."""
        cost = self.model.remote.pass_cost(self.cache.session.route_spans())
        rows = len(self.live)
        return cost if rows == 1 else (lambda n_tokens: cost(rows * n_tokens))

    def _pick(self, row: Row, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """A draft model's next token: its argmax, or a sample from its processed distribution."""
        if not self.do_sample:
            return int(logits.argmax()), None
        probs = torch.softmax(self._process(row, row.drafter.tokens, logits), dim=-1)
        return int(torch.multinomial(probs, 1, generator=row.generator)), probs

    @staticmethod
    def _process(row: Row, context: list[int], logits: torch.Tensor) -> torch.Tensor:
        """The row's processors on one position's logits [V], given the tokens before it."""
        if not row.processors:
            return logits.float()
        return row.processors(torch.tensor([context]), logits.float()[None])[0]

    def _verify(self, row: Row, drafts: list[int], q, logits: torch.Tensor) -> list[int]:
        """logits [k + 1, V] at the positions after row.text + drafts[:i]: the tokens this pass yields."""
        scores = torch.stack([self._process(row, row.text + drafts[:i], logits[i]) for i in range(len(drafts) + 1)])
        if not self.do_sample:
            return verify_greedy(drafts, scores)
        if not drafts:  # one token, drawn as transformers draws it
            return [int(torch.multinomial(torch.softmax(scores, dim=-1)[0], 1, generator=row.generator))]
        return verify_sampling(drafts, torch.softmax(scores.double(), dim=-1), q, row.generator)


def _of_row(value, row: int):
    """A setting given once for every row, or as a list of one per row."""
    return value[row] if isinstance(value, (list, tuple)) else value


def _as_list(value, rows: int) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value] * rows


def _until_eos(tokens: list[int], eos: tuple[int, ...]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens
