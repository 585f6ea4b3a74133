"""One request's generation through the swarm: a session per choice, one token per step, OpenAI's sampling.

The swarm calls block (the client's gRPC loop runs on its own thread), so each choice runs its whole token loop on
a worker thread and hands its events to the request's asyncio queue: many requests proceed at once, each with
its own session, and the servers batch their steps together. A choice's session is closed as soon as it ends,
fails, or its client goes away (checked between tokens; the step in flight finishes first).
"""
from __future__ import annotations

import asyncio
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import AsyncIterator, Sequence

import torch
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from swarmlm.api.metrics import GatewayMetrics
from swarmlm.api.schemas import SEED_RANGE
from swarmlm.types import Span


class RequestTimeout(Exception):
    """The request ran past its deadline (the backstop behind every other limit)."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int  # new tokens at most (finish_reason "length" when reached)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 0 = greedy
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the generated tokens
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token's and k alternatives

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (0 <= self.temperature and 0 <= self.top_p <= 1):
            raise ValueError(f"temperature ({self.temperature}) must be >= 0 and top_p ({self.top_p}) in [0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_p == 0


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
class Token:
    id: int
    logprob: float  # the model's log-probability of this token (before penalties and temperature)
    top: tuple[tuple[int, float], ...] = ()  # the k most likely tokens and their log-probabilities


class ChoiceDecoder:
    """One choice's session, stepped one token at a time from a worker thread."""

    def __init__(self, model, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        self.model = model
        self.params = params
        self.ids = torch.tensor([list(prompt_ids)], dtype=torch.long)  # [1, L + generated]
        self.prompt_tokens = len(prompt_ids)
        self.session = None
        self.closed = False
        self.lock = threading.Lock()  # a close waits for the step in flight
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed % SEED_RANGE)  # any integer: torch takes [0, 2**64)
        else:
            self.generator.seed()
        self.processors = LogitsProcessorList()
        if params.presence_penalty or params.frequency_penalty:
            self.processors.append(
                OpenAIPenalties(self.prompt_tokens, params.presence_penalty, params.frequency_penalty))
        if not params.greedy:
            if params.temperature != 1.0:
                self.processors.append(TemperatureLogitsWarper(params.temperature))
            if params.top_p < 1.0:
                self.processors.append(TopPLogitsWarper(params.top_p))

    def step(self) -> Token:
        with self.lock:
            if self.closed:
                raise RuntimeError("this choice was closed")
            if self.session is None:  # prefill: open the session and send the whole prompt
                self.session = self.model.inference_session(
                    max_length=self.prompt_tokens + self.params.max_tokens, batch_size=1,
                    l_in_hint=self.prompt_tokens, l_out_hint=self.params.max_tokens,
                ).open(prompt_ids=self.ids[0].tolist())  # from a prefix the servers cached, if any
                step_ids = self.ids
            else:
                step_ids = self.ids[:, -1:]
            logits = self.model.step_logits(self.session, step_ids, None, last_only=True)[:, -1, :].float()  # [1, V]
            token = self._choose(logits)
            self.ids = torch.cat([self.ids, torch.tensor([[token.id]])], dim=1)
            return token

    def route(self) -> tuple[Span, ...]:
        """The servers and blocks this choice went through (the last ones, after a failover)."""
        return tuple(self.session.route_spans()) if self.session is not None else ()

    @torch.inference_mode()
    def _choose(self, logits: torch.Tensor) -> Token:
        scores = self.processors(self.ids, logits) if len(self.processors) else logits
        if self.params.greedy:
            next_id = int(scores.argmax(dim=-1))
        else:
            probs = torch.softmax(scores, dim=-1)
            next_id = int(torch.multinomial(probs, 1, generator=self.generator))
        if self.params.top_logprobs is None:
            return Token(next_id, 0.0)
        logprobs = torch.log_softmax(logits, dim=-1)[0]
        top: tuple = ()
        if self.params.top_logprobs:
            values, indices = logprobs.topk(self.params.top_logprobs)
            top = tuple(zip(indices.tolist(), values.tolist()))
        return Token(next_id, float(logprobs[next_id]), top)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            if self.session is not None:
                self.session.close()


class StopText:
    """The decoded text of the generated tokens, released only up to what can no longer turn into a stop string
    (or an incomplete UTF-8 character); truncated at the first stop string."""

    def __init__(self, tokenizer, stops: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.ids: list[int] = []
        self.released = 0  # characters handed out so far
        self.text = ""
        self.stopped = False

    def add(self, token_id: int) -> str:
        """The new text this token releases (may be empty)."""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, text = True, text[:cut]
            hold = 0
        else:
            hold = self._held_back(text)
        self.text = text
        end = max(len(text) - hold, self.released)
        delta, self.released = text[self.released:end], end
        return delta

    def flush(self) -> str:
        """At the end: whatever was held back."""
        delta, self.released = self.text[self.released:], len(self.text)
        return delta

    def _held_back(self, text: str) -> int:
        if text.endswith("\ufffd"):  # a multi-byte character split across tokens
            return 1
        return max((n for s in self.stops for n in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:n])), default=0)


@dataclass(frozen=True)
class Piece:
    """Generated text of one choice; `token` is None for the text released at the end."""

    index: int
    text: str
    token: Token | None


@dataclass(frozen=True)
class Finish:
    index: int
    reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    route: tuple[Span, ...] = ()  # the servers and blocks the choice went through


LONG_TEXT_CHARS = 16_384  # a text this long takes milliseconds to tokenize (~5 us per character here) and MBs


class Engine:
    """Holds the swarm client and the worker threads that drive its sessions and tokenize prompts."""

    def __init__(self, model, tokenizer, metrics: GatewayMetrics, max_workers: int = 64,
                 long_text_workers: int = 2) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="swarmlm-api")
        # long prompts are tokenized at most this many at once (CPU and memory in proportion to their length);
        # short ones never wait behind them
        self.long_text_pool = ThreadPoolExecutor(max_workers=long_text_workers, thread_name_prefix="swarmlm-tok")
        self.eos = set(model.eos_token_id)

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def tokenize(self, encode, chars: int):
        """encode() off the event loop: a long prompt must not stall /health or other requests."""
        pool = self.long_text_pool if chars > LONG_TEXT_CHARS else None  # None: asyncio's default executor
        return await asyncio.get_running_loop().run_in_executor(pool, encode)

    def _generate(self, index: int, prompt_ids: Sequence[int], params: SamplingParams, emit,
                  stop: threading.Event) -> None:
        """One choice, start to end, on a worker thread. The next step leaves as soon as a token is chosen: the
        event loop (HTTP, JSON) never sits between two steps, so concurrent choices stay in step and the servers
        batch them. `stop` (the client went away, or the request's deadline passed) is checked between tokens.
        Whatever fails here (building the decoder included) ends the request with that error."""
        decoder = None
        try:
            decoder = ChoiceDecoder(self.model, prompt_ids, params)
            self._decode(decoder, index, len(prompt_ids), params, emit, stop)
        except BaseException as exc:  # handed to the request, which raises it
            emit(exc if isinstance(exc, Exception) else RuntimeError(f"the choice ended: {type(exc).__name__}"))
        finally:
            if decoder is not None:
                decoder.close()

    def _decode(self, decoder: ChoiceDecoder, index: int, prompt_tokens: int, params: SamplingParams, emit,
                stop: threading.Event) -> None:
        text = StopText(self.tokenizer, params.stop)
        t0 = time.perf_counter()
        first_s, generated, reason = 0.0, 0, "length"
        while generated < params.max_tokens and not stop.is_set():
            token = decoder.step()
            generated += 1
            if generated == 1:
                first_s = time.perf_counter() - t0
            self.metrics.token()
            if token.id in self.eos:
                reason = "stop"
                break
            emit(Piece(index, text.add(token.id), token))
            if text.stopped:
                reason = "stop"
                break
        decoder.close()  # before the end is announced: a finished request holds no session
        if stop.is_set():
            return
        rest = text.flush()
        if rest:
            emit(Piece(index, rest, None))
        total_s = time.perf_counter() - t0
        self.metrics.finished(first_s, (total_s - first_s) / (generated - 1) if generated > 1 else None)
        emit(Finish(index, reason, prompt_tokens, generated, decoder.route()))

    async def merged(self, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int,
                     timeout_s: float = math.inf) -> AsyncIterator[Piece | Finish]:
        """Every choice (n per prompt, each its own session, run concurrently) as its events come; choice i of a
        seeded request uses seed + i so the choices differ and repeat. Closing this generator (the client went
        away) stops every choice after its step in flight and closes its session; so does the deadline, which
        raises RequestTimeout."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()

        def emit(event) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the loop is gone (shutdown): nobody is listening any more
                stop.set()

        def lost(future) -> None:  # a choice that never ran (the pool shut down) still ends its request
            if not future.cancelled() and future.exception() is not None:
                emit(future.exception())

        self.metrics.request_started()
        deadline = time.monotonic() + timeout_s
        try:
            remaining = 0
            for i, ids in enumerate(prompts):
                for j in range(n):
                    index = i * n + j
                    p = params if params.seed is None else replace(params, seed=params.seed + index)
                    self.pool.submit(self._generate, index, ids, p, emit, stop).add_done_callback(lost)
                    remaining += 1
            while remaining:
                try:
                    event = await asyncio.wait_for(queue.get(), max(deadline - time.monotonic(), 0.0))
                except asyncio.TimeoutError:
                    raise RequestTimeout(f"the request did not finish within {timeout_s:g} s") from None
                if isinstance(event, BaseException):
                    raise event
                if isinstance(event, Finish):
                    remaining -= 1
                yield event
        finally:
            stop.set()
            self.metrics.request_ended()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.long_text_pool.shutdown(wait=False, cancel_futures=True)
