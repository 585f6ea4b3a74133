"""Generation through the swarm.

`RemoteCache` is the swarm session as transformers' `generate()` sees a KV cache: the attention caches live on
the servers, this object holds the session, how many tokens it has seen, and the client's clocks. With it,
`DistributedModelForCausalLM.generate()` is transformers' own `GenerationMixin.generate` (every logits processor,
stopping criterion and streamer).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from swarmlm.errors import InvalidRequest


@dataclass
class GenerationStats:
    """Client-side clocks of one generate() call; server-side ones are in the session's step records."""

    prompt_tokens: int = 0
    new_tokens: int = 0  # per sequence
    ttft_s: float = 0.0  # from the call to the first token chosen
    total_s: float = 0.0
    open_s: float = 0.0  # routing + opening streams
    embed_s: float = 0.0
    head_s: float = 0.0  # final norm + LM head
    sample_s: float = 0.0  # between forwards: transformers' logits processors, sampling, stopping criteria
    route: list[str] = field(default_factory=list)
    steps: list = field(default_factory=list)  # the session's StepRecords: per-hop server and wire timings
    speculation: dict | None = None  # speculative generation's passes, drafts, acceptance (SpeculationStats)

    @property
    def tokens_per_s(self) -> float:
        decode_s = self.total_s - self.ttft_s
        return (self.new_tokens - 1) / decode_s if self.new_tokens > 1 and decode_s > 0 else 0.0


class RemoteCache(Cache):
    """transformers' view of a swarm session: `get_seq_length()` is the tokens the servers hold.

    The session opens at the first forward (its batch is the rows transformers sends, its length what
    `generate()` reserves for the cache) unless the caller gave an open one; `finish()` closes only a session
    this cache opened. The servers cannot reorder or fork their caches, so beam search is refused.
    """

    def __init__(self, model, session=None, stats: GenerationStats | None = None) -> None:
        super().__init__(layers=[])  # nothing local: every layer's cache is on a server
        self.model = model
        self.session = session
        self.owned = session is None  # close() closes only a session we opened
        self.max_length: int | None = session.max_length if session is not None else None
        self.stats = stats if stats is not None else GenerationStats()
        self.t_start = time.perf_counter()
        self.t_last_forward: float | None = None  # end of the previous forward: the time in between is sampling

    # ---- what transformers reads from a cache --------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.session.position if self.session is not None else 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_length or -1

    @property
    def is_linear(self) -> list[bool]:
        return [False]  # an attention cache: transformers then slices prompts that restart from it

    @property
    def is_sliding(self) -> list[bool]:
        return [False]

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise InvalidRequest("the swarm's servers cannot reorder their attention caches: no beam search")

    def crop(self, max_length: int) -> None:
        raise InvalidRequest("the swarm's servers cannot crop their attention caches")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise InvalidRequest("the swarm's servers cannot copy their attention caches across rows")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise InvalidRequest("the swarm's servers cannot select rows of their attention caches")

    # ---- the session -----------------------------------------------------------------------------------------
    def session_for(self, batch: int, new_tokens: int):
        """The open session, opening it for `batch` rows on the first call."""
        if self.session is None:
            length = max(self.max_length or 0, new_tokens)
            self.session = self.model.inference_session(max_length=length, batch_size=batch, l_in_hint=new_tokens,
                                                        l_out_hint=max(length - new_tokens, 1)).open()
            self.stats.open_s = self.session.open_s
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
                self.stats.route = [f"{s.server_id}[{s.start}:{s.end})" for s in self.session.route_spans()]
                self.stats.steps = list(self.session.steps)
        finally:
            if self.owned and self.session is not None:
                self.session.close()
        if sequences is not None:
            self.stats.new_tokens = int(sequences.shape[1]) - self.stats.prompt_tokens
        self.stats.total_s = time.perf_counter() - self.t_start
        return self.stats
