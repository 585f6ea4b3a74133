"""One request's generation through the swarm: a session per choice (a prompt's n choices share one, api/group.py),
one token per step or a speculative pass's tokens, OpenAI's sampling.

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

from swarmlm.api.group import ChoiceGroup
from swarmlm.api.metrics import GatewayMetrics
from swarmlm.api.schemas import SEED_RANGE
from swarmlm.client.remote_cache import RemoteCache
from swarmlm.client.speculative import SpeculativeDecoder, SpeculativeMode, parse_mode
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
    prefix_scope: bytes | None = None  # whose cached prefixes (the requesting user's, api/admission.py); None: shared

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
    """One choice's session, stepped from a worker thread: one token per step, or with `speculative` (client/
    speculative.py) 1 to k + 1 tokens per pass (prompt-lookup drafts, verified so that greedy output is plain
    greedy's and sampled output follows the same distribution; a seed then draws a different, equally likely text)."""

    def __init__(self, model, prompt_ids: Sequence[int], params: SamplingParams,
                 speculative: SpeculativeMode = "off") -> None:
        self.model = model
        self.params = params
        self.ids = torch.tensor([list(prompt_ids)], dtype=torch.long)  # [1, L + generated]
        self.prompt_tokens = len(prompt_ids)
        self.session = None
        self.speculative = speculative if parse_mode(speculative) != 0 else None
        self.speculator: SpeculativeDecoder | None = None  # with `speculative`, from the prompt's step on
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

    @torch.no_grad()
    def step(self) -> list[Token]:
        """The next tokens: one per step, or those a speculative pass yields (at most the max_tokens left)."""
        with self.lock:
            if self.closed:
                raise RuntimeError("this choice was closed")
            if self.session is None:  # prefill: open the session and send the whole prompt
                self.session = self.model.inference_session(
                    max_length=self.prompt_tokens + self.params.max_tokens, batch_size=1,
                    l_in_hint=self.prompt_tokens, l_out_hint=self.params.max_tokens,
                    prefix_scope=self.params.prefix_scope,
                ).open(prompt_ids=None if self.speculative is not None else self.ids[0].tolist())  # from a prefix
                # the servers cached, if any (a speculating choice starts from scratch)
                if self.speculative is not None:
                    self.speculator = SpeculativeDecoder(self.model, RemoteCache(self.model, self.session),
                                                         self.processors, not self.params.greedy, self.speculative,
                                                         generator=self.generator)
                    ids, logits = self.speculator.start(self.ids[0].tolist())
                    return self.take_pass(ids, logits)
                step_ids = self.ids
            elif self.speculator is not None:
                ids, logits = self.speculator.advance(self.room)
                return self.take_pass(ids, logits)
            else:
                step_ids = self.ids[:, -1:]
            logits = self.model.step_logits(self.session, step_ids, None, last_only=True)[:, -1, :].float()  # [1, V]
            return [self.accept(logits)]

    def accept(self, logits: torch.Tensor) -> Token:
        """The next token from its logits [1, V] (this choice's processors and generator), appended to the text."""
        token = self._choose(logits)
        self.ids = torch.cat([self.ids, torch.tensor([[token.id]])], dim=1)
        return token

    @property
    def room(self) -> int:
        """Tokens this choice may still generate."""
        return self.params.max_tokens - (self.ids.shape[1] - self.prompt_tokens)

    def take_pass(self, ids: list[int], logits: torch.Tensor) -> list[Token]:
        """A speculative pass's tokens, each with the logits [V] of its position (for logprobs), appended to the
        text."""
        self.ids = torch.cat([self.ids, torch.tensor([ids])], dim=1)
        return [self._token(t, row[None].float()) for t, row in zip(ids, logits)]

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
        return self._token(next_id, logits)

    def _token(self, next_id: int, logits: torch.Tensor) -> Token:
        """The chosen token with the log-probabilities asked for, from its position's logits [1, V]."""
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


class ChoiceProgress:
    """One choice's output as its tokens come: the text released up to a stop string, the finish reason, timings."""

    def __init__(self, engine: "Engine", index: int, prompt_tokens: int, params: SamplingParams, emit) -> None:
        self.engine, self.index, self.prompt_tokens, self.params, self.emit = engine, index, prompt_tokens, params, emit
        self.text = StopText(engine.tokenizer, params.stop)
        self.t0 = time.perf_counter()
        self.first_s, self.generated, self.reason = 0.0, 0, "length"

    def take(self, token: Token) -> bool:
        """Count and emit one token; True when the choice has ended (eos, a stop string, max_tokens)."""
        self.generated += 1
        if self.generated == 1:
            self.first_s = time.perf_counter() - self.t0
        self.engine.metrics.token()
        if token.id in self.engine.eos:
            self.reason = "stop"
            return True
        self.emit(Piece(self.index, self.text.add(token.id), token))
        if self.text.stopped:
            self.reason = "stop"
        return self.text.stopped or self.generated >= self.params.max_tokens

    def finish(self, route: tuple[Span, ...]) -> None:
        """The held-back text and the Finish event (after the choice's session was closed or left)."""
        rest = self.text.flush()
        if rest:
            self.emit(Piece(self.index, rest, None))
        total_s = time.perf_counter() - self.t0
        self.engine.metrics.finished(self.first_s, (total_s - self.first_s) / (self.generated - 1)
                                     if self.generated > 1 else None)
        self.emit(Finish(self.index, self.reason, self.prompt_tokens, self.generated, route))


LONG_TEXT_CHARS = 16_384  # a text this long takes milliseconds to tokenize (~5 us per character here) and MBs


class Engine:
    """Holds the swarm client and the worker threads that drive its sessions and tokenize prompts."""

    def __init__(self, model, tokenizer, metrics: GatewayMetrics, max_workers: int = 64,
                 long_text_workers: int = 2, speculative: SpeculativeMode = "off") -> None:
        self.model = model
        self.speculative = speculative  # every choice's (ChoiceDecoder): "off", "auto" or a fixed draft length
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
            decoder = ChoiceDecoder(self.model, prompt_ids, params, self.speculative)
            self._decode(decoder, index, len(prompt_ids), params, emit, stop)
        except BaseException as exc:  # handed to the request, which raises it
            emit(exc if isinstance(exc, Exception) else RuntimeError(f"the choice ended: {type(exc).__name__}"))
        finally:
            if decoder is not None:
                decoder.close()

    def _decode(self, decoder: ChoiceDecoder, index: int, prompt_tokens: int, params: SamplingParams, emit,
                stop: threading.Event) -> None:
        progress = ChoiceProgress(self, index, prompt_tokens, params, emit)
        while not stop.is_set() and not any(progress.take(token) for token in decoder.step()):
            pass  # several tokens per step when speculating; take() is True at the choice's end
        decoder.close()  # before the end is announced: a finished request holds no session
        if not stop.is_set():
            progress.finish(decoder.route())

    def _generate_group(self, first: int, prompt_ids: Sequence[int], params: list[SamplingParams], emit,
                        stop: threading.Event) -> None:
        """n choices of one prompt in one session (api/group.py), choice `first + i` in row i, on a worker thread."""
        group = None
        try:
            group = ChoiceGroup(self.model, prompt_ids, [ChoiceDecoder(self.model, prompt_ids, p) for p in params],
                                self.speculative)
            progress = {first + i: ChoiceProgress(self, first + i, len(prompt_ids), p, emit)
                        for i, p in enumerate(params)}
            while group.live and not stop.is_set():
                for row, tokens in group.step().items():
                    # several tokens per step when speculating; take() is True at the choice's end
                    if any(progress[first + row].take(token) for token in tokens):
                        group.drop(row)
                        progress[first + row].finish(group.route())
        except BaseException as exc:  # handed to the request, which raises it
            emit(exc if isinstance(exc, Exception) else RuntimeError(f"the choices ended: {type(exc).__name__}"))
        finally:
            if group is not None:
                group.close()

    async def merged(self, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int,
                     timeout_s: float = math.inf) -> AsyncIterator[Piece | Finish]:
        """Every choice (n per prompt, run concurrently) as its events come: the n choices of a prompt share one
        session and its prompt's step (api/group.py), speculating or not; choice i of a seeded
        request uses seed + i so the choices differ and repeat. Closing this generator (the client went
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
                choices = [params if params.seed is None else replace(params, seed=params.seed + i * n + j)
                           for j in range(n)]
                if n > 1:  # one prefill, its cache copied to n rows (speculating or not)
                    self.pool.submit(self._generate_group, i * n, ids, choices, emit, stop).add_done_callback(lost)
                else:
                    for j, p in enumerate(choices):
                        self.pool.submit(self._generate, i * n + j, ids, p, emit, stop).add_done_callback(lost)
                remaining += n
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
