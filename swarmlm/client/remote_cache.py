"""Generation through the swarm.

`RemoteCache` is the swarm session as transformers' `generate()` sees a KV cache: the attention caches live on
the servers, this object holds the session, how many tokens it has seen, and the client's clocks. With it,
`DistributedModelForCausalLM.generate()` is transformers' own `GenerationMixin.generate` (every logits processor,
stopping criterion and streamer), beam search, assisted and prompt lookup decoding included: the cache's edits
(`crop`, `reorder_cache`, `batch_select_indices`, `batch_repeat_interleave`) are recorded as one pending
`CacheOp` that travels with the next step (docs/PROTOCOL.md, "Cache operations"): no round trip of their own.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from swarmlm.errors import InvalidRequest
from swarmlm.types import CacheOp, Span


@dataclass
class GenerationStats:
    """Client-side clocks of one generate() call; server-side ones are in the session's step records."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, found in the servers' prefix caches (not sent, not computed again)
    new_tokens: int = 0  # per sequence
    ttft_s: float = 0.0  # from the call to the first token chosen
    total_s: float = 0.0
    open_s: float = 0.0  # routing + opening streams
    embed_s: float = 0.0
    head_s: float = 0.0  # final norm + LM head
    sample_s: float = 0.0  # between forwards: transformers' logits processors, sampling, stopping criteria
    route: tuple[Span, ...] = ()  # the servers and blocks of the session at its end
    steps: list = field(default_factory=list)  # the session's StepRecords: per-hop server and wire timings
    speculation: dict | None = None  # speculative generation's passes, drafts, acceptance (SpeculationStats)

    @property
    def tokens_per_s(self) -> float:
        decode_s = self.total_s - self.ttft_s
        return (self.new_tokens - 1) / decode_s if self.new_tokens > 1 and decode_s > 0 else 0.0


class RemoteCache(Cache):
    """transformers' view of a swarm session: `get_seq_length()` is the tokens the servers hold (after the pending
    edit).

    The session opens at the first forward (its batch is the rows transformers sends, its length what
    `generate()` reserves for the cache) unless the caller gave an open one; `finish()` closes only a session
    this cache opened. Edits of the cache are kept in `pending` until the next forward sends them with its step.
    """

    def __init__(self, model, session=None, stats: GenerationStats | None = None) -> None:
        super().__init__(layers=[])  # nothing local: every layer's cache is on a server
        self.model = model
        self.session = session
        self.owned = session is None  # close() closes only a session we opened
        self.max_length: int | None = session.max_length if session is not None else None
        self.stats = stats if stats is not None else GenerationStats()
        self.pending: CacheOp | None = None  # the edit the next step carries
        # the first forward may start from a cached prefix of the prompt (its logits: the last position's only);
        # generate() turns it off for modes that read more of the prefill (assisted and prompt lookup decoding)
        self.use_prefix = True
        self.prefix_scope: bytes | None = None  # the scope a session it opens uses (None: the client's own)
        # positions the session holds before the tokens transformers sees (a soft prompt's): not counted for it
        self.virtual_tokens = 0
        self.t_start = time.perf_counter()
        self.t_last_forward: float | None = None  # end of the previous forward: the time in between is sampling

    # ---- what transformers reads from a cache --------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        held = self.session.position if self.session is not None else 0
        return (held if self.pending is None else self.pending.kept(held)) - self.virtual_tokens * (held > 0)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_length or -1

    @property
    def is_linear(self) -> list[bool]:
        return [False]  # an attention cache: transformers then slices prompts that restart from it

    @property
    def is_sliding(self) -> list[bool]:
        return [False]  # the servers keep every token (sliding windows are masks there): crop can always go back

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return True

    # ---- edits: recorded, sent with the next step --------------------------------------------------------------
    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove tokens (transformers 5: a count <= 0; a positive one is refused there)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove")
        if tokens_to_remove < 0:
            self._edit(CacheOp(truncate_to=max(self.get_seq_length() + tokens_to_remove, 0) + self.virtual_tokens))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx.tolist())

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(indices.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select([row for row in range(self.rows) for _ in range(repeats)])

    @property
    def rows(self) -> int:
        """Sequences the cache holds after the pending edit."""
        held = self.session.rows if self.session is not None else 0
        return held if self.pending is None else self.pending.rows_after(held)

    def _select(self, rows: list[int]) -> None:
        if self.get_seq_length() == 0:
            return  # nothing held: nothing to select (as transformers' empty layers)
        if any(not 0 <= r < self.rows for r in rows) or not rows:
            raise InvalidRequest(f"cache rows {rows[:8]}... out of range: the cache holds {self.rows} rows")
        if rows != list(range(self.rows)):  # beam search often keeps its beams in place: nothing to send
            self._edit(CacheOp(rows=tuple(rows)))

    def _edit(self, op: CacheOp) -> None:
        self.pending = op if self.pending is None else self.pending.then(op)

    def take_pending(self) -> CacheOp | None:
        """The edit for the step about to run (and no more after it)."""
        op, self.pending = self.pending, None
        return op

    # ---- the session -----------------------------------------------------------------------------------------
    def session_for(self, batch: int, new_tokens: int, prompt: torch.Tensor | None = None):
        """The open session, opening it for `batch` rows on the first call (from a cached prefix of `prompt`, one
        sequence's ids, when the servers hold one)."""
        if self.session is None:
            length = max((self.max_length or 0) + self.virtual_tokens, new_tokens)
            self.session = self.model.inference_session(max_length=length, batch_size=batch, l_in_hint=new_tokens,
                                                        l_out_hint=max(length - new_tokens, 1),
                                                        prefix_scope=self.prefix_scope).open(
                prompt.tolist() if prompt is not None else None)
            self.stats.open_s = self.session.open_s
            self.stats.cached_tokens = self.session.position
        return self.session

    def before_forward(self) -> None:
        if self.t_last_forward is not None:
            self.stats.sample_s += time.perf_counter() - self.t_last_forward

    def after_forward(self) -> None:
        self.t_last_forward = time.perf_counter()
        if not self.stats.ttft_s:
            self.stats.ttft_s = self.t_last_forward - self.t_start

    def finish(self, sequences: torch.Tensor | None) -> GenerationStats:
        """Close a session we opened; the stats of the whole call."""
        try:
            if self.session is not None:
                self.stats.route = tuple(self.session.route_spans())
                self.stats.steps = list(self.session.steps)
        finally:
            if self.owned and self.session is not None:
                self.session.close()
        if sequences is not None:
            self.stats.new_tokens = int(sequences.shape[1]) - self.stats.prompt_tokens
        self.stats.total_s = time.perf_counter() - self.t_start
        return self.stats
