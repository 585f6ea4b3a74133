"""Speculative generation through the swarm: more than one token per trip along the route.

Every pass sends the newest token plus k drafted ones (client/drafting.py) as ONE step of k + 1 tokens, so the
servers return the model's scores at every position; the client keeps the verified prefix plus one token of the
model's own (client/verification.py) and tells the servers to drop the rejected drafts from their caches, with the
next step (`RemoteCache.crop`: a pending cache op the next step carries, no extra round trip). Passes go through
the model's `forward()` with the `RemoteCache`, the path transformers' own generate() takes. k is chosen before each
pass, per row, from the row's acceptance estimate and the route's measured pass cost (perf/speculation.py), or fixed
by the caller.

    text      a row's tokens: the prompt's and every one chosen since; the newest is chosen, not sent yet
    head      what the row's next step sends first: text[sent:] (tokens it owes the servers, then the newest)
    pass      step [head, d_1..d_k] -> scores [k + 1, V] at head[-1], d_1..d_k -> tokens t_1..t_{n+1}
              (n drafts accepted); the row keeps len(head) + n positions of the step; text += t_1..t_{n+1}

A batch (B rows in one session: a batch of prompts, num_return_sequences copies of one, the API's n choices) holds
one length for all rows, and rows accept different numbers of drafts. Each row's step is right-padded to the
widest (mask 0 on the tail: real tokens first, so every real position's logits are exact under causal attention,
positions counted from the mask); the servers keep, in every row, the fewest positions any row keeps (spec_rows.py):
the kept region holds real tokens only, and a row's accepted tokens past it are owed, sent again first in its next
step. With one row nothing is ever owed: the pass is [last, d_1..d_k] and the rejected drafts are cut.

Greedy output is exactly plain greedy decoding's; sampled output follows the model's own distribution. Supported:
greedy or sampling with temperature / top-k / top-p / repetition penalty, eos and max_new_tokens, batches
(left-padded prompts too) and sampled num_return_sequences; any other option runs transformers' plain generate()
(`unsupported`).
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Union

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from swarmlm.client.drafting import DraftModel, PromptLookup
from swarmlm.client.spec_rows import Row, common_cut, draft_limit, padded_step, real_tokens
from swarmlm.client.verification import verify_greedy, verify_sampling
from swarmlm.perf.speculation import MAX_DRAFT_TOKENS, MeasuredPassCost, choose_draft_length

SpeculativeMode = Union[str, int]  # "auto": k from the rule per pass, "off": plain decoding, an int: that fixed k
DEFAULT_MAX_DRAFT = 8  # k_max for "auto"
DRAFT_MODEL_KIND = 0  # a draft model's drafts in the acceptance estimate (prompt lookup's: the match length, >= 1)


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


@dataclass
class SpeculationStats:
    """What speculation did in one generate() call (GenerationStats.speculation)."""

    passes: int = 0  # steps through the route after the prompt's
    drafted: int = 0  # draft tokens sent
    accepted: int = 0  # of them kept
    tokens: int = 0  # tokens the passes yielded
    draft_s: float = 0.0  # client time spent drafting
    draft_lengths: list[int] = field(default_factory=list)  # k sent per pass
    by_kind: dict[int, list[int]] = field(default_factory=dict)  # draft kind -> [drafted, accepted]
    resent: int = 0  # accepted tokens sent again: past what every row of the batch kept (spec_rows.py)
    rows: list["SpeculationStats"] = field(default_factory=list)  # a batch's: each row's own

    @classmethod
    def of_rows(cls, rows: list["SpeculationStats"], passes: int) -> "SpeculationStats":
        """A batch's: every row's counts summed, `passes` the trips (tokens_per_pass: the batch's tokens per trip)."""
        total = cls(passes=passes, rows=list(rows))
        for row in rows:
            total.drafted += row.drafted
            total.accepted += row.accepted
            total.tokens += row.tokens
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
        self.tokens += accepted + 1
        self.draft_lengths.append(drafted)
        if drafted:
            counts = self.by_kind.setdefault(kind, [0, 0])
            counts[0] += drafted
            counts[1] += accepted

    @property
    def tokens_per_pass(self) -> float:
        return self.tokens / self.passes if self.passes else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def to_dict(self) -> dict:
        return {"passes": self.passes, "drafted": self.drafted, "accepted": self.accepted, "tokens": self.tokens,
                "tokens_per_pass": self.tokens_per_pass, "acceptance_rate": self.acceptance_rate,
                "mean_k": sum(self.draft_lengths) / len(self.draft_lengths) if self.draft_lengths else 0.0,
                "by_kind": {str(kind): counts for kind, counts in sorted(self.by_kind.items())},
                "resent": self.resent, **({"rows": [row.to_dict() for row in self.rows]} if self.rows else {})}


def unsupported(config: GenerationConfig) -> str | None:
    """Why this generation cannot speculate (it then runs plainly), or None. A batch speculates (each row its own
    drafts, spec_rows.py), and so do sampled num_return_sequences (the prompt's cache copied to each)."""
    if config.num_beams > 1:
        return "beam search"
    if (config.num_return_sequences or 1) > 1 and not config.do_sample:
        return "several return sequences without sampling"
    for name in ("stop_strings", "min_new_tokens", "no_repeat_ngram_size", "bad_words_ids", "force_words_ids",
                 "suppress_tokens", "begin_suppress_tokens", "sequence_bias", "guidance_scale", "max_time"):
        if getattr(config, name, None):
            return f"{name} is set"
    if (getattr(config, "min_length", 0) or 0) > 0 or getattr(config, "min_p", None) \
            or (getattr(config, "typical_p", 1.0) or 1.0) < 1.0 or getattr(config, "epsilon_cutoff", 0.0) \
            or getattr(config, "eta_cutoff", 0.0):
        return "a logits processor speculation does not apply"
    return None


def processors_of(config: GenerationConfig) -> LogitsProcessorList:
    """transformers' own processors for the options `unsupported` lets through, in generate()'s order."""
    out = LogitsProcessorList()
    if config.repetition_penalty not in (None, 1.0):
        out.append(RepetitionPenaltyLogitsProcessor(config.repetition_penalty))
    if config.do_sample:
        if config.temperature not in (None, 1.0):
            out.append(TemperatureLogitsWarper(config.temperature))
        if config.top_k not in (None, 0):
            out.append(TopKLogitsWarper(config.top_k))
        if config.top_p not in (None, 1.0):
            out.append(TopPLogitsWarper(config.top_p))
    return out


class SpeculativeDecoder:
    """Speculative generation of the rows of an open session: `start_rows` (the prompts' step), then `advance_rows`
    (one pass for every running row) until the caller has enough, `drop` a row that ended (it leaves the session with
    the next step); `generate_rows` is that loop. `start` / `advance` / `generate` are the one-row case.
    `processors` score each position given the tokens before it (transformers' LogitsProcessorList; one for every
    row, or a list of one per row, as `generator`); `do_sample` False is greedy."""

    def __init__(self, model, cache, processors, do_sample: bool, mode: SpeculativeMode = "auto",
                 draft_model=None, generator=None, k_max: int = DEFAULT_MAX_DRAFT) -> None:
        self.model = model
        self.cache = cache  # RemoteCache: the session, and the edit the next step carries
        self.do_sample = bool(do_sample)
        self.processors = processors  # LogitsProcessorList, or one per row
        self.fixed_k = parse_mode(mode)
        self.k_max = min(k_max, MAX_DRAFT_TOKENS) if self.fixed_k is None else self.fixed_k
        self.draft_model = draft_model
        self.generator = generator  # torch.Generator | None, or one per row
        self.rows: list[Row] = []  # every row, in the order the caller numbers them
        self.live: list[int] = []  # rows still running, in their session order after the next step's edit
        self._source: dict[int, int] = {}  # running row -> the session row that holds its cache now
        self._written = 0  # width of the last pass's step (0: the next step carries no cut)
        self.passes = 0  # trips through the route after the prompts' step
        self.measured = MeasuredPassCost()  # the model's pass price, corrected by this session's passes

    @classmethod
    def for_config(cls, model, cache, config: GenerationConfig, mode: SpeculativeMode = "auto", draft_model=None,
                   generator: torch.Generator | None = None) -> "SpeculativeDecoder":
        return cls(model, cache, processors_of(config), bool(config.do_sample), mode, draft_model, generator)

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
                      eos: tuple[int, ...] = (), copies: int = 1, on_tokens=None) -> list[list[int]]:
        """New tokens of every row (at most max_new_tokens, ending at the first eos): prompts ids [B, T] (left-padded
        where mask [B, T] is 0), each `copies` times (rows i * copies ...). on_tokens(row, list): each pass's."""
        passed = self.start_rows(ids, mask, copies)
        new: list[list[int]] = [[] for _ in self.rows]
        while True:
            for row, (tokens, _) in passed.items():
                tokens = _until_eos(tokens[:max_new_tokens - len(new[row])], eos)
                new[row] += tokens
                if on_tokens is not None:
                    on_tokens(row, tokens)
                if len(new[row]) >= max_new_tokens or (eos and new[row][-1] in eos):
                    self.drop(row)
            if not self.live:
                return new
            passed = self.advance_rows({row: max_new_tokens - len(new[row]) for row in self.live})

    def start(self, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
        """One row's prompt step: ([first token], its logits [1, V])."""
        return self.start_rows(torch.tensor([prompt]))[0]

    def advance(self, room: int) -> tuple[list[int], torch.Tensor]:
        """One row's pass, with drafts for at most `room` - 1 more tokens: (the 1 to k + 1 tokens it yields, the
        logits [len(tokens), V] each was chosen from, before the processors)."""
        return self.advance_rows({0: room})[0]

    def start_rows(self, ids: torch.Tensor, mask: torch.Tensor | None = None,
                   copies: int = 1) -> dict[int, tuple[list[int], torch.Tensor]]:
        """The prompts' step: ids [B, T] (left-padded where mask [B, T] is 0), each prompt continued by `copies` rows
        (its cache copied with the next step). {row: ([first token], its logits [1, V])}."""
        if self.rows:
            raise RuntimeError("start_rows() twice")
        prompts = real_tokens(ids, mask)
        mask = mask if mask is not None and not bool(mask.all()) else None
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
        return out

    def advance_rows(self, rooms: dict[int, int]) -> dict[int, tuple[list[int], torch.Tensor]]:
        """One pass for every running row, row r with drafts for at most rooms[r] - 1 more tokens: {row: (the 1 to
        k + 1 tokens it yields, the logits [len(tokens), V] each was chosen from, before the processors)}."""
        if not self.live:
            raise RuntimeError("advance() with no row running (before start(), or after every row ended)")
        self._settle()
        free = self.cache.session.max_length - self.cache.get_seq_length()
        model_cost = functools.cache(self._pass_cost)  # asked only when drafts are sized by the rule
        cost = lambda: self.measured.corrected(model_cost())  # noqa: E731
        heads = [self.rows[r].head for r in self.live]
        # a row's owed tokens count against its drafts: a row ahead of the batch's slowest waits for it
        limits = [draft_limit(self.k_max, len(head), rooms[r], free) for r, head in zip(self.live, heads)]
        drafted = self._draft_rows(limits, cost)
        steps = [head + drafts for head, (drafts, _, _) in zip(heads, drafted)]
        ids, mask = padded_step(steps)
        width = ids.shape[1]
        first = width - min(len(head) for head in heads)  # the leftmost logits any row reads: at its newest token
        t0 = time.perf_counter()
        logits = self.model(input_ids=ids, attention_mask=mask, cache=self.cache,
                            logits_to_keep=first + 1).logits  # [B, first + 1, V]
        elapsed = time.perf_counter() - t0
        predicted = model_cost()(width) if self.fixed_k is None else 0.0
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
            out[r] = (tokens, own[:len(tokens)])
        self.passes += 1
        self._written = width
        return out

    def drop(self, row: int) -> None:
        """Row `row` has ended: it leaves the session with the next step."""
        self.live.remove(row)

    # ---- its parts ----------------------------------------------------------------------------------------
    def _new_row(self, r: int, prompt: list[int]) -> Row:
        drafter = DraftModel(self.draft_model) if self.draft_model is not None else PROMPT_LOOKUP
        return Row(text=list(prompt), sent=len(prompt), processors=_of_row(self.processors, r),
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
        return cost if rows == 1 else (lambda tokens: cost(rows * tokens))

    def _draft_rows(self, limits: list[int], cost) -> list[tuple[list[int], list | None, int | None]]:
        """Every running row's drafts (at most limits[i] for the i-th): (drafts, their distributions q or None for
        one-hot / greedy, their kind for the acceptance estimate). Prompt lookup drafts first (free) and sizes k by
        the match it found; a draft model costs time per token, so k is chosen before it drafts.

        In "auto" the rows draft as one: the servers keep the fewest positions any row keeps, so a row's drafts
        accepted past the slowest row's are sent again on every later pass until that row catches up (in open-ended
        text, rarely): a batch moves at its slowest row's pace. k is chosen once, with the lowest of the rows'
        acceptance estimates (0 when a row has no draft; rows quote or ramble together, so their acceptances go
        together rather than independently) and the batch's pass cost. One row is the case of a batch of one."""
        rows = [self.rows[r] for r in self.live]
        t0 = time.perf_counter()
        if isinstance(rows[0].drafter, PromptLookup):
            found = [row.drafter.lookup(torch.tensor(row.text), limit) if limit > 0 else ([], 0)
                     for row, limit in zip(rows, limits)]
            rate = min(row.estimate.rate(n) if drafts else 0.0 for row, (drafts, n) in zip(rows, found))
            k = self._draft_length(rate, max(len(d) for d, _ in found), cost)
            for row in rows:
                row.stats.draft_s += (time.perf_counter() - t0) / len(rows)
            return [(drafts[:k], None, n) if k and drafts else ([], None, None) for drafts, n in found]
        rate = min(row.estimate.rate(DRAFT_MODEL_KIND) for row in rows)
        k = self._draft_length(rate, max(limits), cost, sum(row.draft_s_per_token for row in rows))
        return [self._model_drafts(row, min(k, limit)) for row, limit in zip(rows, limits)]

    def _draft_length(self, rate: float, limit: int, cost, draft_s: float = 0.0) -> int:
        """The draft length for a pass: the caller's fixed k, or the rule's (0 where no draft is likely)."""
        if limit <= 0:
            return 0
        if self.fixed_k is not None:
            return min(self.fixed_k, limit)
        return choose_draft_length(rate, cost(), limit, draft_s) if rate > 0 else 0

    def _model_drafts(self, row: Row, k: int) -> tuple[list[int], list | None, int | None]:
        """k drafts from the row's draft model (measuring what a draft token costs)."""
        if k <= 0:
            return [], None, None
        t0 = time.perf_counter()
        drafts, q = row.drafter.draft(torch.tensor(row.text), k, lambda logits: self._pick(row, logits))
        elapsed = time.perf_counter() - t0
        row.draft_s_per_token = elapsed / k if not row.draft_s_per_token else \
            0.8 * row.draft_s_per_token + 0.2 * elapsed / k
        row.stats.draft_s += elapsed
        return drafts, q if self.do_sample else None, DRAFT_MODEL_KIND

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
        return verify_sampling(drafts, torch.softmax(scores.double(), dim=-1), q, row.generator)


PROMPT_LOOKUP = PromptLookup()  # stateless: every row drafts with it


def _of_row(value, row: int):
    """A setting given once for every row, or as a list of one per row (a LogitsProcessorList is one setting)."""
    return value[row] if isinstance(value, (list, tuple)) and not isinstance(value, LogitsProcessorList) else value


def _until_eos(tokens: list[int], eos: tuple[int, ...]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens
