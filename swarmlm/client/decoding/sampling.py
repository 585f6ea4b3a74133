"""One sampling-parameters type for every caller: built from a transformers `GenerationConfig` (generate()) or an
API request (the gateway), it gives transformers' own logits processors in generate()'s order, the token choice
(greedy: argmax; otherwise a draw from the processed distribution), the logprobs asked for and the seed.

    processors  repetition penalty, OpenAI's presence / frequency penalties, then (sampling only) temperature,
                top-k, top-p, min-p: as transformers' _get_logits_processor applies them
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

SEED_RANGE = 2 ** 64  # torch generators take seeds in [0, 2**64): any integer is taken modulo this


def unsupported(config: GenerationConfig) -> str | None:
    """Why a GenerationConfig is more than a Sampling (generate() then runs transformers' own loop), or None. A
    batch and sampled num_return_sequences (the prompt's cache copied to each) are the decoder's too."""
    if config.num_beams > 1:
        return "beam search"
    if (config.num_return_sequences or 1) > 1 and not config.do_sample:
        return "several return sequences without sampling"
    for name in ("stop_strings", "min_new_tokens", "no_repeat_ngram_size", "bad_words_ids", "force_words_ids",
                 "suppress_tokens", "begin_suppress_tokens", "sequence_bias", "guidance_scale", "max_time", "top_h"):
        if getattr(config, name, None):
            return f"{name} is set"
    if (getattr(config, "min_length", 0) or 0) > 0 or (getattr(config, "typical_p", 1.0) or 1.0) < 1.0 \
            or getattr(config, "epsilon_cutoff", 0.0) or getattr(config, "eta_cutoff", 0.0):
        return "a logits processor the decoder does not apply"
    return None


class OpenAIPenalties(LogitsProcessor):
    """logit[j] -= frequency * count[j] + presence * (count[j] > 0), counting generated tokens only."""

    def __init__(self, prompt_tokens: int, presence: float, frequency: float) -> None:
        self.prompt_tokens = prompt_tokens
        self.presence = presence
        self.frequency = frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[:, self.prompt_tokens:]
        if generated.shape[1] == 0:
            return scores
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


@dataclass(frozen=True)
class Sampling:
    """How one sequence chooses its tokens. `do_sample` False is greedy (the only definition of it)."""

    max_new_tokens: int  # new tokens at most
    do_sample: bool = True  # False: argmax of the processed scores (the warpers below then do nothing)
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off; a token needs at least min_p x the top token's probability
    repetition_penalty: float = 1.0  # transformers' (CTRL's): over the prompt's and the generated tokens; 1: off
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the generated tokens
    stop: tuple[str, ...] = ()  # stop strings (the gateway's; generate() refuses them with speculation)
    seed: int | None = None  # the generator's seed (any integer, taken modulo SEED_RANGE); None: a fresh one
    top_logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token's and k alternatives
    # whose prefixes the session starts from and saves on the servers: a gateway user's own scope (api/admission.py);
    # None: the client's one scope
    prefix_scope: bytes | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature <= 0 and self.do_sample:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if not (0 <= self.top_p <= 1 and 0 <= self.min_p <= 1 and self.top_k >= 0 and self.repetition_penalty > 0):
            raise ValueError(f"top_p ({self.top_p}) and min_p ({self.min_p}) must be in [0, 1], top_k "
                             f"({self.top_k}) >= 0 and repetition_penalty ({self.repetition_penalty}) > 0")

    @classmethod
    def from_request(cls, max_tokens: int, temperature: float = 1.0, top_p: float = 1.0, **fields) -> "Sampling":
        """An API request's parameters: temperature 0 or top_p 0 is greedy (OpenAI's convention)."""
        greedy = temperature == 0 or top_p == 0
        return cls(max_new_tokens=max_tokens, do_sample=not greedy, temperature=temperature if not greedy else 1.0,
                   top_p=top_p if not greedy else 1.0, **fields)

    @classmethod
    def from_generation_config(cls, config: GenerationConfig, max_new_tokens: int) -> "Sampling":
        """generate()'s parameters (the options speculation covers; `unsupported` names the others)."""
        return cls(max_new_tokens=max_new_tokens, do_sample=bool(config.do_sample),
                   temperature=config.temperature if config.temperature is not None else 1.0,
                   top_k=config.top_k or 0, top_p=config.top_p if config.top_p is not None else 1.0,
                   min_p=config.min_p or 0.0,
                   repetition_penalty=config.repetition_penalty if config.repetition_penalty is not None else 1.0)

    @property
    def greedy(self) -> bool:
        return not self.do_sample

    def processors(self, prompt_tokens: int = 0) -> LogitsProcessorList:
        """transformers' processors for these parameters, in generate()'s order (OpenAI's penalties count the
        tokens after the first `prompt_tokens`)."""
        out = LogitsProcessorList()
        if self.repetition_penalty != 1.0:
            out.append(RepetitionPenaltyLogitsProcessor(self.repetition_penalty))
        if self.presence_penalty or self.frequency_penalty:
            out.append(OpenAIPenalties(prompt_tokens, self.presence_penalty, self.frequency_penalty))
        if self.do_sample:
            if self.temperature != 1.0:
                out.append(TemperatureLogitsWarper(self.temperature))
            if self.top_k:
                out.append(TopKLogitsWarper(self.top_k))
            if self.top_p < 1.0:
                out.append(TopPLogitsWarper(self.top_p))
            if self.min_p:
                out.append(MinPLogitsWarper(self.min_p))
        return out

    def generator(self, offset: int = 0) -> torch.Generator:
        """A generator for one sequence: seeded with seed + offset (the n choices of a request differ and repeat),
        or from fresh entropy."""
        generator = torch.Generator()
        if self.seed is not None:
            generator.manual_seed((self.seed + offset) % SEED_RANGE)
        else:
            generator.seed()
        return generator

    def logprobs(self, token: int, logits: torch.Tensor) -> tuple[float, tuple[tuple[int, float], ...]]:
        """The chosen token's log-probability under the model (its position's logits [1, V], before the
        processors) and the top_logprobs most likely tokens with theirs; (0.0, ()) when none were asked for."""
        if self.top_logprobs is None:
            return 0.0, ()
        logprobs = torch.log_softmax(logits.float(), dim=-1)[0]
        top: tuple = ()
        if self.top_logprobs:
            values, indices = logprobs.topk(self.top_logprobs)
            top = tuple(zip(indices.tolist(), values.tolist()))
        return float(logprobs[token]), top

    def choose(self, scores: torch.Tensor, generator: torch.Generator | None) -> int:
        """The token chosen from one position's processed scores [1, V]."""
        if self.greedy:
            return int(scores.argmax(dim=-1))
        return int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator))


@contextlib.contextmanager
def sampling_rng(generator: torch.Generator | None):
    """transformers samples with torch's global generator: run it from `generator`'s state, then hand the advanced
    state back to `generator` and restore the global one."""
    if generator is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(generator.get_state())
        try:
            yield
        finally:
            generator.set_state(torch.get_rng_state())
