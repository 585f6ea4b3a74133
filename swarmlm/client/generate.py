"""Token generation: prefill, then one decode step per token, through an inference session.

Greedy and sampled decoding follow `transformers.generate()`: the same logits warpers in the same order
(temperature, top-k, top-p), finished rows padded with pad_token_id, stop when every row has ended.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from swarmlm.errors import InvalidRequest


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 20
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = 50  # transformers' default when sampling
    top_p: float = 1.0
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidRequest(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.do_sample and self.temperature <= 0:
            raise InvalidRequest(f"temperature must be > 0 when sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")

    def warpers(self) -> LogitsProcessorList:
        warpers = LogitsProcessorList()
        if self.do_sample:
            if self.temperature != 1.0:
                warpers.append(TemperatureLogitsWarper(self.temperature))
            if self.top_k:
                warpers.append(TopKLogitsWarper(self.top_k))
            if self.top_p < 1.0:
                warpers.append(TopPLogitsWarper(self.top_p))
        return warpers


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
    sample_s: float = 0.0
    route: list[str] = field(default_factory=list)
    steps: list = field(default_factory=list)  # the session's StepRecords: per-hop server and wire timings

    @property
    def tokens_per_s(self) -> float:
        decode_s = self.total_s - self.ttft_s
        return (self.new_tokens - 1) / decode_s if self.new_tokens > 1 and decode_s > 0 else 0.0


def select_next(logits: torch.Tensor, ids: torch.Tensor, cfg: SamplingConfig, warpers: LogitsProcessorList,
                generator: torch.Generator | None) -> torch.Tensor:
    """logits: [B, V] of the last position -> next token ids [B]."""
    scores = warpers(ids, logits.float()) if len(warpers) else logits.float()
    if cfg.do_sample:
        probs = torch.softmax(scores, dim=-1)
        return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
    return scores.argmax(dim=-1)


def generate_tokens(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cfg: SamplingConfig,
                    generator: torch.Generator | None = None, session=None) -> tuple[torch.Tensor, GenerationStats]:
    """Returns the prompt followed by the new tokens, [B, L + n] (n <= max_new_tokens), as generate() does."""
    t_start = time.perf_counter()
    stats = GenerationStats(prompt_tokens=int(input_ids.shape[1]))
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise InvalidRequest(f"input_ids must be [batch, tokens] with tokens >= 1, got {list(input_ids.shape)}")
    batch, length = input_ids.shape
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(torch.long)
    warpers = cfg.warpers()
    eos = torch.tensor(cfg.eos_token_id, dtype=torch.long)
    if len(cfg.eos_token_id) and cfg.pad_token_id is None:
        raise InvalidRequest("pad_token_id is needed to pad rows that ended with eos")
    own_session = session is None
    if own_session:
        session = model.inference_session(max_length=length + cfg.max_new_tokens, batch_size=batch,
                                          l_in_hint=length, l_out_hint=cfg.max_new_tokens).open()
    try:
        stats.open_s = getattr(session, "open_s", 0.0)
        ids = input_ids
        unfinished = torch.ones(batch, dtype=torch.long)
        step_ids, step_mask = input_ids, mask
        for n in range(cfg.max_new_tokens):
            logits = model.step_logits(session, step_ids, step_mask, stats, last_only=True)
            t0 = time.perf_counter()
            next_tokens = select_next(logits[:, -1, :], ids, cfg, warpers, generator)
            if len(cfg.eos_token_id):
                next_tokens = next_tokens * unfinished + cfg.pad_token_id * (1 - unfinished)
            ids = torch.cat([ids, next_tokens[:, None]], dim=1)
            stats.sample_s += time.perf_counter() - t0
            if n == 0:
                stats.ttft_s = time.perf_counter() - t_start
            stats.new_tokens = n + 1
            if len(cfg.eos_token_id):
                unfinished = unfinished & ~torch.isin(next_tokens, eos)
                if not unfinished.any():
                    break
            step_ids, step_mask = next_tokens[:, None], torch.ones(batch, 1, dtype=torch.long)
        stats.route = [f"{s.server_id}[{s.start}:{s.end})" for s in session.route_spans()]
        stats.steps = list(session.steps)
    finally:
        if own_session:
            session.close()
    stats.total_s = time.perf_counter() - t_start
    return ids, stats
