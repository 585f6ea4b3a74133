"""What the benchmark sends: prompts from a file or the built-in set, or synthetic ones; optional Poisson arrivals.

A workload is a list of `Request`s with token ids already made, so every strategy sends exactly the same tokens.
`arrival_s` is None in a closed loop (the next request goes as soon as a worker is free, as in the scaling study)
or an offset from the start of the run in an open loop (requests wait at the client until they arrive).
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Literal, Sequence

BUILTIN = "builtin"


@dataclass(frozen=True)
class PromptSpec:
    text: str
    max_new_tokens: int | None = None  # None: the benchmark's default

    def __post_init__(self) -> None:
        if not self.text.strip():
            raise ValueError("empty prompt")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class Request:
    request_id: int
    input_ids: tuple[int, ...]  # the prompt's tokens, no padding
    max_new_tokens: int
    arrival_s: float | None = None  # open loop: when it reaches the client, from the start of the run

    def __post_init__(self) -> None:
        if not self.input_ids:
            raise ValueError(f"request {self.request_id} has no tokens")
        if self.max_new_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.arrival_s is not None and self.arrival_s < 0:
            raise ValueError(f"request {self.request_id}: arrival_s must be >= 0, got {self.arrival_s}")


# ---- prompt sources ----------------------------------------------------------------------------------------

def load_prompt_file(path: str | Path) -> list[PromptSpec]:
    """Text (one prompt per line) or JSONL ({"prompt": ..., "max_new_tokens": optional}); blank lines skipped."""
    path = Path(path)
    specs: list[PromptSpec] = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                obj = json.loads(line)
                specs.append(PromptSpec(str(obj["prompt"]), obj.get("max_new_tokens")))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: expected a JSON object with a 'prompt' field ({exc})") from None
        else:
            specs.append(PromptSpec(line))
    if not specs:
        raise ValueError(f"{path}: no prompts")
    return specs


def builtin_prompts() -> list[PromptSpec]:
    """The shipped set: ~270 questions, instructions, definitions, commonsense sentences and short readings
    (7-120 tokens with the checkpoints' tokenizer, mean ~37, close to the study's WinoGrande/PromptSET/DefAn mix)."""
    text = resources.files("swarmlm.bench").joinpath("data/prompts.jsonl").read_text(encoding="utf-8")
    return [PromptSpec(json.loads(line)["prompt"]) for line in text.splitlines() if line.strip()]


def prompt_source(name: str) -> list[PromptSpec]:
    return builtin_prompts() if name == BUILTIN else load_prompt_file(name)


def tokenize(specs: Sequence[PromptSpec], tokenizer, max_new_tokens: int, limit: int | None = None) -> list[Request]:
    """Prompts -> requests (the first `limit` of them), with the tokenizer the checkpoint ships."""
    specs = list(specs)[:limit] if limit else list(specs)
    out = []
    for i, spec in enumerate(specs):
        ids = tuple(int(t) for t in tokenizer(spec.text).input_ids)
        out.append(Request(i, ids, spec.max_new_tokens or max_new_tokens))
    return out


# ---- synthetic workloads -----------------------------------------------------------------------------------

Distribution = Literal["fixed", "uniform", "normal", "lognormal"]


@dataclass(frozen=True)
class LengthSpec:
    """Prompt lengths in tokens: fixed `mean`, or drawn and clipped to [min_tokens, max_tokens]."""

    distribution: Distribution = "fixed"
    mean_tokens: float = 32.0
    spread: float = 0.0  # uniform: half-width in tokens; normal: std in tokens; lognormal: sigma of log(length)
    min_tokens: int = 1
    max_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.distribution not in ("fixed", "uniform", "normal", "lognormal"):
            raise ValueError(f"unknown distribution {self.distribution!r}")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"need 1 <= min_tokens ({self.min_tokens}) <= max_tokens ({self.max_tokens})")
        if self.mean_tokens <= 0 or self.spread < 0:
            raise ValueError(f"mean_tokens must be > 0 and spread >= 0, got {self.mean_tokens}, {self.spread}")

    def draw(self, rng: random.Random) -> int:
        if self.distribution == "fixed":
            x = self.mean_tokens
        elif self.distribution == "uniform":
            x = rng.uniform(self.mean_tokens - self.spread, self.mean_tokens + self.spread)
        elif self.distribution == "normal":
            x = rng.gauss(self.mean_tokens, self.spread)
        else:  # lognormal with the given mean: mu = log(mean) - sigma^2 / 2
            x = rng.lognormvariate(math.log(self.mean_tokens) - self.spread ** 2 / 2, self.spread)
        return int(min(max(round(x), self.min_tokens), self.max_tokens))


def synthetic(n: int, lengths: LengthSpec, vocab_size: int, max_new_tokens: int, seed: int = 0,
              first_id: int = 4) -> list[Request]:
    """n requests of random token ids (ids below `first_id` are the special tokens, never drawn)."""
    if n < 1 or vocab_size <= first_id:
        raise ValueError(f"need n >= 1 and vocab_size > {first_id}, got {n}, {vocab_size}")
    rng = random.Random(seed)
    return [Request(i, tuple(rng.randrange(first_id, vocab_size) for _ in range(lengths.draw(rng))), max_new_tokens)
            for i in range(n)]


def fixed_length(n: int, input_tokens: int, vocab_size: int, max_new_tokens: int, seed: int = 0) -> list[Request]:
    return synthetic(n, LengthSpec("fixed", input_tokens, min_tokens=1, max_tokens=input_tokens), vocab_size,
                     max_new_tokens, seed)


def poisson_arrivals(requests: Sequence[Request], rate_per_s: float, seed: int = 0) -> list[Request]:
    """Open loop: exponential gaps of mean 1 / rate_per_s between arrivals, the first at 0."""
    if rate_per_s <= 0:
        raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for i, r in enumerate(requests):
        if i:
            t += rng.expovariate(rate_per_s)
        out.append(replace(r, arrival_s=t))
    return out
