"""Speculative generation through the swarm: more than one token per trip along the route.

Every pass sends the newest token plus k drafted ones (client/drafting.py) as ONE step of k + 1 tokens, so the
servers return the model's scores at every position; the client keeps the verified prefix plus one token of the
model's own (client/verification.py) and tells the servers to drop the rejected drafts from their caches, with the
next step (`RemoteCache.crop`: a pending cache op the next step carries, no extra round trip). Passes go through
the model's `forward()` with the `RemoteCache`, the path transformers' own generate() takes. k is chosen before each pass from the session's
acceptance estimate and the route's measured pass cost (perf/speculation.py), or fixed by the caller.

    context  tokens the servers hold (after the truncation that goes with the next step)
    last     the newest token: chosen, not sent yet
    pass     step [last, d_1..d_k] -> scores [k + 1, V] -> tokens t_1..t_{n+1} (n drafts accepted)
             context += [last, d_1..d_n]; last = t_{n+1}; the servers drop d_{n+1}..d_k

Greedy output is exactly plain greedy decoding's; sampled output follows the model's own distribution. Supported:
one sequence, greedy or sampling with temperature / top-k / top-p / repetition penalty, eos and max_new_tokens; any
other option runs transformers' plain generate() (`unsupported`).
"""
from __future__ import annotations

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
from swarmlm.client.verification import verify_greedy, verify_sampling
from swarmlm.perf.speculation import MAX_DRAFT_TOKENS, AcceptanceByMatch, choose_draft_length

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
                "by_kind": {str(kind): counts for kind, counts in sorted(self.by_kind.items())}}


def unsupported(config: GenerationConfig, batch: int) -> str | None:
    """Why this generation cannot speculate (it then runs plainly), or None."""
    if batch != 1:
        return "more than one sequence"
    if config.num_beams > 1 or config.num_return_sequences > 1:
        return "beam search or several return sequences"
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
    """One sequence's speculative generation in an open session (batch 1): `start` (the prompt), then `advance`
    (one pass) until the caller has enough; `generate` is that loop. `processors` score each position given the
    tokens before it (transformers' LogitsProcessorList); `do_sample` False is greedy."""

    def __init__(self, model, cache, processors: LogitsProcessorList, do_sample: bool, mode: SpeculativeMode = "auto",
                 draft_model=None, generator: torch.Generator | None = None,
                 k_max: int = DEFAULT_MAX_DRAFT) -> None:
        self.model = model
        self.cache = cache  # RemoteCache: the session, and the edit the next step carries
        self.do_sample = bool(do_sample)
        self.processors = processors
        self.fixed_k = parse_mode(mode)
        self.k_max = min(k_max, MAX_DRAFT_TOKENS) if self.fixed_k is None else self.fixed_k
        self.drafter = DraftModel(draft_model) if draft_model is not None else PromptLookup()
        self.generator = generator
        self.estimate = AcceptanceByMatch()  # per kind of draft: prompt lookup's match length, or the draft model
        self.stats = SpeculationStats()
        self._draft_s_per_token = 0.0  # measured, a draft model's; prompt lookup costs ~nothing
        self.context: list[int] = []  # the tokens the servers hold (after the truncation the next step carries)
        self.last: int | None = None  # the newest token: chosen, not sent yet (it goes first in the next pass)

    @classmethod
    def for_config(cls, model, cache, config: GenerationConfig, mode: SpeculativeMode = "auto", draft_model=None,
                   generator: torch.Generator | None = None) -> "SpeculativeDecoder":
        return cls(model, cache, processors_of(config), bool(config.do_sample), mode, draft_model, generator)

    # ---- the loop -----------------------------------------------------------------------------------------
    def generate(self, prompt: list[int], max_new_tokens: int, eos: tuple[int, ...] = (),
                 on_tokens=None) -> list[int]:
        """New tokens after `prompt` (at most max_new_tokens, ending at the first eos). on_tokens(list): each pass's."""
        new: list[int] = []
        tokens, _ = self.start(prompt)
        while True:
            tokens = _until_eos(tokens[:max_new_tokens - len(new)], eos)
            new += tokens
            if on_tokens is not None:
                on_tokens(tokens)
            if len(new) >= max_new_tokens or (eos and new[-1] in eos):
                return new
            tokens, _ = self.advance(max_new_tokens - len(new))

    def start(self, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
        """The prompt's step: ([first token], its logits [1, V])."""
        logits = self.model(input_ids=torch.tensor([prompt]), cache=self.cache, logits_to_keep=1).logits[0]  # [1, V]
        tokens = self._verify(prompt, [], None, logits)
        self.context, self.last = list(prompt), tokens[-1]
        return tokens, logits

    def advance(self, room: int) -> tuple[list[int], torch.Tensor]:
        """One pass, with drafts for at most `room` - 1 more tokens: (the 1 to k + 1 tokens it yields, the logits
        [len(tokens), V] each was chosen from, before the processors)."""
        if self.last is None:
            raise RuntimeError("advance() before start()")
        tokens, logits = self._pass(self.context, self.last, room)
        self.context += [self.last] + tokens[:-1]  # the servers keep last and the accepted drafts
        self.last = tokens[-1]
        return tokens, logits[:len(tokens)]

    def _pass(self, context: list[int], last: int, room: int) -> list[int]:
        """One trip along the route: [last] + drafts; the tokens it yields (1 to k + 1) and its logits [k + 1, V]."""
        session = self.cache.session
        held = self.cache.get_seq_length()  # after the truncation the next step carries (= len(context))
        drafts, q, kind = self._draft(context + [last], min(self.k_max, room - 1, session.max_length - held - 1))
        ids = torch.tensor([[last] + drafts])
        logits = self.model(input_ids=ids, cache=self.cache).logits[0]  # [k + 1, V]
        tokens = self._verify(context + [last], drafts, q, logits)
        accepted = len(tokens) - 1
        if accepted < len(drafts):  # the rejected drafts leave the servers' caches with the next step
            self.cache.crop(accepted - len(drafts))
        self.estimate.update(kind if drafts else None, len(drafts), accepted)
        self.stats.record(kind, len(drafts), accepted)
        return tokens, logits

    # ---- its parts ----------------------------------------------------------------------------------------
    def _draft(self, context: list[int], limit: int) -> tuple[list[int], list | None, int | None]:
        """(drafts, their distributions q or None for one-hot / greedy, their kind for the acceptance estimate).
        Prompt lookup drafts first (free) and sizes k by the match it found; a draft model costs time per token,
        so k is chosen before it drafts."""
        if limit <= 0:
            return [], None, None
        t0 = time.perf_counter()
        if isinstance(self.drafter, PromptLookup):
            drafts, n = self.drafter.lookup(torch.tensor(context), limit)
            k = self._draft_length(n, len(drafts)) if drafts else 0
            self.stats.draft_s += time.perf_counter() - t0
            return drafts[:k], None, n
        k = self._draft_length(DRAFT_MODEL_KIND, limit)
        if k == 0:
            return [], None, None
        drafts, q = self.drafter.draft(torch.tensor(context), k, self._pick)
        elapsed = time.perf_counter() - t0
        self._draft_s_per_token = elapsed / k if not self._draft_s_per_token else \
            0.8 * self._draft_s_per_token + 0.2 * elapsed / k
        self.stats.draft_s += elapsed
        return drafts, q if self.do_sample else None, DRAFT_MODEL_KIND

    def _draft_length(self, kind: int, limit: int) -> int:
        if self.fixed_k is not None:
            return min(self.fixed_k, limit)
        cost = self.model.remote.pass_cost(self.cache.session.route_spans())
        return choose_draft_length(self.estimate.rate(kind), cost, limit, self._draft_s_per_token)

    def _pick(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """A draft model's next token: its argmax, or a sample from its processed distribution."""
        if not self.do_sample:
            return int(logits.argmax()), None
        probs = torch.softmax(self._process(self.drafter.tokens, logits), dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator)), probs

    def _process(self, context: list[int], logits: torch.Tensor) -> torch.Tensor:
        """The processors on one position's logits [V], given the tokens before it."""
        if not self.processors:
            return logits.float()
        return self.processors(torch.tensor([context]), logits.float()[None])[0]

    def _verify(self, before: list[int], drafts: list[int], q, logits: torch.Tensor) -> list[int]:
        """logits [k + 1, V] at the positions after `before` + drafts[:i]: the tokens this pass yields."""
        scores = torch.stack([self._process(before + drafts[:i], logits[i]) for i in range(len(drafts) + 1)])
        if not self.do_sample:
            return verify_greedy(drafts, scores)
        return verify_sampling(drafts, torch.softmax(scores.double(), dim=-1), q, self.generator)


def _until_eos(tokens: list[int], eos: tuple[int, ...]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens
