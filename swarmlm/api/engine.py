"""One request's generation through the swarm: the n choices of each prompt are the rows of one decoder
(client/decoding/decoder.py: one session, the prompt's step once, one token per step or a speculative pass's tokens
per row), each choosing with the request's Sampling and its own seed.

The swarm calls block (the client's gRPC loop runs on its own thread), so each choice runs its whole token loop on
a worker thread and hands its events to the request's asyncio queue: many requests proceed at once, each with
its own session, and the servers batch their steps together. A choice leaves its session as soon as it ends; the
session is closed when the last one ends, fails, or its client goes away (checked between steps; the step in flight
finishes first).
"""
from __future__ import annotations

import asyncio
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

import torch

from swarmlm.api.metrics import GatewayMetrics
from swarmlm.client.decoding.decoder import Decoder, SpeculativeMode
from swarmlm.client.decoding.sampling import Sampling
from swarmlm.types import Span


class RequestTimeout(Exception):
    """The request ran past its deadline (the backstop behind every other limit)."""


@dataclass(frozen=True)
class Token:
    id: int
    logprob: float  # the model's log-probability of this token (before penalties and temperature)
    top: tuple[tuple[int, float], ...] = ()  # the k most likely tokens and their log-probabilities


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

    def __init__(self, engine: "Engine", index: int, prompt_tokens: int, params: Sampling, emit) -> None:
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
        return self.text.stopped or self.generated >= self.params.max_new_tokens

    def take_pass(self, tokens: list[int], logits: torch.Tensor) -> bool:
        """A step's tokens for this choice, each with its position's logits [len(tokens), V] (for logprobs); True
        when the choice has ended (the tokens after its end are not taken)."""
        return any(self.take(Token(t, *self.params.logprobs(t, logits[i:i + 1]))) for i, t in enumerate(tokens))

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
        self.speculative = speculative  # every decoder's: "off", "auto" or a fixed draft length
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

    def _generate(self, model, first: int, prompt_ids: Sequence[int], params: Sampling, n: int, seed_offset: int,
                  emit, stop: threading.Event, context_tokens: int | None) -> None:
        """The n choices of one prompt (choice `first + row` in the decoder's row `row`), start to end, on a worker
        thread. The next step leaves as soon as the tokens are chosen: the event loop (HTTP, JSON) never sits
        between two steps, so concurrent requests stay in step and the servers batch them. `stop` (the client went
        away, or the request's deadline passed) is checked between steps. Whatever fails here (building the decoder
        included) ends the request with that error."""
        decoder = None
        try:
            decoder = Decoder(model, params, self.speculative, context_tokens=context_tokens,
                              generator=[params.generator(seed_offset + row) for row in range(n)])
            progress = [ChoiceProgress(self, first + row, len(prompt_ids), params, emit) for row in range(n)]
            passed = decoder.start_rows(torch.tensor([list(prompt_ids)]), copies=n)
            while not stop.is_set():
                ended = [row for row, (tokens, logits) in passed.items() if progress[row].take_pass(tokens, logits)]
                for row in ended:
                    decoder.drop(row)
                route = decoder.route()
                if not decoder.live:
                    decoder.close()  # before the last end is announced: a finished request holds no session
                if not stop.is_set():
                    for row in ended:
                        progress[row].finish(route)
                if not decoder.live:
                    return
                passed = decoder.step()
        except BaseException as exc:  # handed to the request, which raises it
            emit(exc if isinstance(exc, Exception) else RuntimeError(f"the choices ended: {type(exc).__name__}"))
        finally:
            if decoder is not None:
                decoder.close()

    async def merged(self, prompts: Sequence[Sequence[int]], params: Sampling, n: int,
                     timeout_s: float = math.inf, context_tokens: int | None = None,
                     model=None) -> AsyncIterator[Piece | Finish]:
        """Every choice (n per prompt, prompts run concurrently) as its events come: the n choices of a prompt are
        the rows of one decoder (one session, the prompt's step once), speculating or not; choice i of a seeded
        request uses seed + i so the choices differ and repeat. `context_tokens`: the servers' limit on a
        session's length; `model`: the served model to run (None: the base, Engine.model). Closing this generator
        (the client went away) stops every choice after its step in flight and closes its session; so does the
        deadline, which raises RequestTimeout."""
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
        deadline = loop.time() + timeout_s
        try:
            remaining = 0
            for i, ids in enumerate(prompts):  # one prefill per prompt, its cache copied to n rows
                self.pool.submit(self._generate, model or self.model, i * n, ids, params, n, i * n, emit, stop,
                                 context_tokens).add_done_callback(lost)
                remaining += n
            while remaining:
                event = await next_event(queue, deadline, timeout_s)
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


async def next_event(queue: asyncio.Queue, deadline: float, timeout_s: float):
    """The request's next event; RequestTimeout once the loop's clock is past `deadline`, even with events waiting.
    asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancellation that comes as its get completes (an
    event already waiting, as when the event loop runs behind the worker threads under load), and a request whose
    client went away would then run on to its last token."""
    try:
        if asyncio.get_running_loop().time() >= deadline:
            raise TimeoutError
        async with asyncio.timeout_at(deadline):
            return await queue.get()
    except TimeoutError:
        raise RequestTimeout(f"the request did not finish within {timeout_s:g} s") from None
