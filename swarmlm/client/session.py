"""An inference session through a chain of servers: open, step, close, and failover (failover.py) with history replay.

A step runs as attempts of the step engine (pipeline.py: chunks through every span, hop by hop or pipelined, every
reply bounded by its server's hang timeout, a watchdog behind them). An attempt that is not complete names the
spans to replace: a failed server (crashed or hung) is banned and its span re-routed (only that part of the chain),
a healthy span left with chunks written but not answered (its cache state unknown to us) is reopened. Per span the
session keeps what it has sent and got answered (hidden states and padding masks); that history is replayed to the
replacement so it rebuilds its attention caches, and the next attempt goes on from the chunks each span has
answered. The answer is the same as if nothing had happened.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from swarmlm.client.chunking import chunk_tokens_for_hop, split
from swarmlm.client.failover import replace_hop
from swarmlm.client import prefix as prefix_keys
from swarmlm.client.pipeline import AttemptOutcome, Chunk, Hop, OpenSpan, StepPipeline, hang_timeout_s, watchdog_s
from swarmlm.client.remote import RemoteSequence, report_failure
from swarmlm.client.frame_call import FrameCall
from swarmlm.client.relay import RelayChain, RelayLane, chain_library
from swarmlm.client.router import profile_of
from swarmlm.client.streams import HopTiming, RelayedHop, SpanStream, relayed_timing
from swarmlm.errors import InvalidRequest, ServerFailed, ServerHung, ServerTampered
from swarmlm.perf.model import ComputeProfile
from swarmlm.small_reads import all_set, no_padding_mask
from swarmlm.swarm.records import ServerRecord
from swarmlm.types import CacheOp, Span
from swarmlm.wire import compress
from swarmlm.wire import swarm_pb2 as pb

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StepRecord:
    """One step through the whole chain: what each hop cost, and failovers."""

    n_tokens: int
    wall_s: float
    hops: list[HopTiming]
    failovers: int = 0
    failover_s: float = 0.0  # re-routing, reopening and replay
    chunks: int = 1  # messages the step's tokens were split into
    reopened: int = 0  # healthy spans reopened because a failure elsewhere left them mid-step
    stalls: int = 0  # times the whole step made no progress for watchdog_s (then every unfinished hop reopens)
    hung: list[str] = field(default_factory=list)  # servers that did not answer within their hang timeout (banned)
    pushed: bool = False  # server-to-server push on this step's route (ClientConfig.push, PerfModel.push_pays)
    push_refused: bool = False  # a server refused to push on: the step was sent again without push
    blocking: bool = False  # its first attempt ran from the caller's thread on framed streams (run_blocking)


_HOPS = StepRecord.hops  # (the slot StepRecord keeps its hops in: LaneStepRecord's property stands in front of it)


class LaneStepRecord(StepRecord):
    """A relay lane's step (client/relay.py RelayLane) recorded as the usual path records a blocking decode step,
    its hops' timings made when they are first read, from the chain's records of them (streams.py `relayed_timing`,
    what the usual path makes at once): right after the wait every object made costs ~10x a warm one, and nothing
    reads them before the next step (docs/RESULTS-hop.md round 21)."""

    __slots__ = ("_unmade",)

    def __init__(self, wall_s: float, unmade: list[RelayedHop], pushed: bool = False) -> None:
        StepRecord.__init__(self, n_tokens=1, wall_s=wall_s, hops=None, pushed=pushed, blocking=True)
        self._unmade = unmade

    @property
    def hops(self) -> list[HopTiming]:
        if self._unmade is not None:
            _HOPS.__set__(self, [relayed_timing(hop) for hop in self._unmade])
            self._unmade = None
        return _HOPS.__get__(self)

    @hops.setter
    def hops(self, hops: list[HopTiming]) -> None:
        _HOPS.__set__(self, hops)
        self._unmade = None


@dataclass(frozen=True)
class PrefixContext:
    """What a session needs to use the servers' prefix caches (client/prefix.py): this client's scope, the parts of
    the keys' salt the client decides, and its embeddings (a failover recomputes a cached prefix's inputs)."""

    scope: bytes
    model_id: str
    client_format: str  # the client's embedding dtype and quantization
    embed: Callable[[torch.Tensor], torch.Tensor]  # token ids [B, T] -> hidden [B, T, H]


class InferenceSession:
    def __init__(self, remote: RemoteSequence, batch: int, max_length: int, l_in_hint: int = 16,
                 l_out_hint: int = 16, prefix: PrefixContext | None = None,
                 deep_prompts: torch.Tensor | None = None, lora: Sequence[pb.LoraWeights] = ()) -> None:
        self.remote = remote
        # [blocks, K, H]: a deep prompt; each span's server gets its blocks' part at open (every open: a
        # replacement too) and adds it at the session's first K positions (server/deep_prompt.py); a client's own
        # LoRA likewise (each server applies its blocks' part in every forward of the session)
        assert deep_prompts is None and not lora or prefix is None, "a tuned model's rows are not the base's"
        self.deep_prompts, self.lora = deep_prompts, tuple(lora)
        self.batch = batch
        self.max_length = max_length
        self.l_in_hint = l_in_hint
        self.l_out_hint = l_out_hint
        self.spans: list[OpenSpan] = []
        self.steps: list[StepRecord] = []
        self.push_refused = False  # a server of this session refused to push on: no push from then on
        self._profiles: dict[str, tuple[ServerRecord, ComputeProfile]] = {}  # server id -> (record, its profile)
        self.open_s = 0.0  # routing + opening streams
        self.closed = False
        # entries are one sequence: a session of more rows opens from one (its first step's one row, copied to the
        # others by a later step's cache op) and keeps none (`held_ids` stops following at the copy)
        self.prefix_context = prefix
        self.held_ids: list[int] | None = [] if self.prefix_context is not None else None  # the ids servers hold
        self.prompt: list[int] = []  # the prompt named at open (its cached prefix is not sent again)
        self._align: CacheOp | None = None  # cuts every span to the prefix all of them hold, with the first step
        # (server id, rows, cached) -> (span, its server's record, the bound): a decode step's hang timeouts, worked
        # out again only when the span or the record (its announced profile) changes
        self._decode_bounds: dict[tuple[str, int, bool], tuple[Span, ServerRecord | None, float]] = {}
        self._relay: RelayChain | None = None  # the route's C chain (client/relay.py), while its streams stay
        self._lane: RelayLane | None = None  # decode steps straight into that chain, while nothing else changes

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def open(self, prompt_ids: Sequence[int] | None = None) -> "InferenceSession":
        """Route and open a stream on every span; a server that fails to open is banned and routed around. With
        `prompt_ids` (the first step's tokens, one sequence), the session may start from a prefix of them the
        servers cached (`position` > 0 then): the first step's ids start with the prompt, and its output covers
        the positions after that prefix only."""
        if self.prefix_context is not None and prompt_ids is not None:
            self.prompt = [int(t) for t in prompt_ids]
        t0 = time.perf_counter()
        attempts = 0
        while True:
            context = self.prefix_context
            held = prefix_keys.announced_held(context.scope, context.model_id, context.client_format,
                                              self.prompt) if self.prompt else None  # routes holding it cost less
            route = self.remote.route(0, self.remote.num_blocks, self.l_in_hint, self.l_out_hint, self.batch,
                                      self.max_length, refresh=attempts > 0, prefix_held=held)
            try:
                self.spans = self.remote.loop.run(self.open_spans(route.spans, self.prompt))
                if self.held_ids is not None:
                    self.held_ids = self.prompt[:self.position]  # what the servers hold from their caches
                break
            except ServerFailed as exc:
                attempts += 1
                if attempts > self.remote.config.max_retries:
                    raise
                report_failure(self.remote.reported, exc.server_id,
                               f"could not open a session: {exc}; routing around it", exc)
                self.remote.view.ban(exc.server_id, tampered=isinstance(exc, ServerTampered))
        self.open_s = time.perf_counter() - t0
        return self

    # ---- what failover.py uses: open and close spans, bound a span's reply ----------------------------------
    async def open_spans(self, spans, prompt: Sequence[int] = ()) -> list[OpenSpan]:
        """Open a session on each span; with a prompt, from the longest prefix of it every span has cached (a span
        holding more is cut to it by the first step's cache op)."""
        cfg = self.remote.config
        opened: list[OpenSpan] = []
        salts = self._salts(spans) if prompt else [b""] * len(spans)
        try:
            for span, salt in zip(spans, salts):
                keys = prefix_keys.keys_for(salt, prompt, leave=1) if prompt else []
                # an open computes nothing: a server that does not answer it within the hang floor is hung
                stream = SpanStream(self.remote.channels, span, min(cfg.step_timeout_s, cfg.hang_floor_s))
                scope = self.prefix_context.scope if keys else b""
                prompts = self.deep_prompts[span.start:span.end] if self.deep_prompts is not None else None
                lora = [w for w in self.lora if span.start <= w.block < span.end]
                held = await stream.open(self.batch, self.max_length, scope, keys, prompts, lora)
                admission = self.remote.router.admit([span], self.l_in_hint, self.l_out_hint)
                opened.append(OpenSpan(span, stream, admission, prefix_tokens=held))
        except BaseException:
            await self.close_spans(opened)
            raise
        common = min((s.prefix_tokens for s in opened), default=0)
        if any(s.prefix_tokens != common for s in opened):
            self._align = CacheOp(truncate_to=common)  # sent with the first step
        for s in opened:
            s.prefix_tokens = common
        return opened

    def _salts(self, spans: Sequence[Span]) -> list[bytes]:
        view, channels = self.remote.view, self.remote.channels
        return prefix_keys.span_salts(
            self.prefix_context.model_id, self.prefix_context.client_format, spans,
            lambda s: view.records[s.server_id].quant if s.server_id in view.records else "?",
            lambda s: channels.wire_dtype_for(s.address, prefix_keys.PREFILL_BYTES))

    async def close_spans(self, spans: list[OpenSpan]) -> None:
        for s in spans:
            await s.stream.close()
            self.remote.router.release(s.admission)

    def close(self) -> None:
        """Close every span's stream; first, with the prefix cache on, ask each server to keep the tokens held."""
        if not self.closed:
            self.closed = True
            self.remote.loop.run(self._save_and_close())

    async def _save_and_close(self) -> None:
        if self.held_ids and len(self.held_ids) >= prefix_keys.RUN_TOKENS and self.spans:
            for s, salt in zip(self.spans, self._salts(self.route_spans())):
                try:
                    await s.stream.save(prefix_keys.keys_for(salt, self.held_ids))
                except ServerFailed as exc:  # a broken stream keeps nothing: not this session's failure
                    log.info("prefix not kept: %s", exc)
        await self.close_spans(self.spans)

    def prefix_held(self, input_ids: torch.Tensor) -> int:
        """Tokens at the start of the first step's `input_ids` that the servers hold from a cached prefix (the
        caller sends the rest); 0 after the first step or without a cached start."""
        held = self.position if self.prompt and not self.steps else 0
        if held and (input_ids.shape[0] != 1 or input_ids[0, :held].tolist() != self.prompt[:held]):
            raise InvalidRequest("the first step's tokens must start with the prompt given at open")
        return held

    def __enter__(self) -> "InferenceSession":
        return self.open() if not self.spans else self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def position(self) -> int:
        return self.spans[0].position if self.spans else 0

    @property
    def rows(self) -> int:
        """Sequences the servers hold (0 while they hold no token; at most `batch`, reserved at open)."""
        return self.spans[0].rows if self.spans else 0

    # ---- steps -------------------------------------------------------------------------------------------
    def step(self, hidden: torch.Tensor, mask: torch.Tensor | None = None, op: CacheOp | None = None,
             token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [B, T, H] after the embeddings; mask: [B, T] of these tokens; op: a cache edit the servers apply
        before them (types.CacheOp; B then follows its rows); token_ids [B, T]: the tokens (for the prefix cache;
        without them the session keeps no prefix). Returns the last block's output."""
        lane, self._lane = self._lane, None  # (taken back by a step it relays whole)
        if lane is not None and mask is None and op is None and lane.takes(hidden):
            return self._lane_step(lane, hidden, token_ids)
        if self._align is not None:  # the open's cached prefixes, cut to the one every span holds
            op, self._align = (self._align if op is None else self._align.then(op)), None
        past, rows = (self.position, self.rows or None) if op is None else op.check(self.position, self.rows,
                                                                                   self.batch)
        if hidden.dim() != 3 or not (hidden.shape[0] == rows or rows is None and 1 <= hidden.shape[0] <= self.batch):
            raise InvalidRequest(f"expected hidden states [{rows or f'1..{self.batch}'}, T, H], got "
                                 f"{list(hidden.shape)}")
        if past + hidden.shape[1] > self.max_length:
            raise InvalidRequest(f"session max_length {self.max_length} reached ({past} tokens held)")
        if mask is None:
            mask, padded = no_padding_mask(*hidden.shape[:2]), False  # (a decode step's: kept, no tensor made)
        else:  # (a torch call saved when it is long already: each costs ~10x right after a forward)
            mask = mask if mask.dtype == torch.long else mask.to(torch.long)
            padded = not all_set(mask)
        t0 = time.perf_counter()
        record, chunks, hops = self._begin(hidden, mask, op)
        if self._blocking_ok(chunks, hops):
            out = self._step_blocking(record, chunks, hops, t0, padded)
        else:
            out = self.remote.loop.run(self._attempts(record, chunks, hops, t0, padded=padded))
        self._track(token_ids, padded, op)
        return out

    def _lane_step(self, lane: RelayLane, hidden: torch.Tensor, token_ids: torch.Tensor | None) -> torch.Tensor:
        """A decode step the relay lane takes (RelayLane.takes): the chain's call; where it stopped short, the usual
        blocking step goes on from there."""
        t0 = time.perf_counter()
        unmade, outs, unfinished = lane.step(hidden)
        if unfinished is None:
            self._lane = lane
            self.steps.append(LaneStepRecord(time.perf_counter() - t0, unmade, lane.pushed))
            out = outs[-1]
        else:
            record, chunks, hops = self._begin(hidden, lane.mask, None)
            out = self._step_blocking(record, chunks, hops, t0, False, relayed=unfinished)
        self._track(token_ids, False, None)
        return out

    def _track(self, token_ids: torch.Tensor | None, padded: bool, op: CacheOp | None) -> None:
        """Follow the token ids the servers hold (to name them at close); one unpadded sequence only."""
        if self.held_ids is None:
            return
        if token_ids is None or token_ids.shape[0] != 1 or padded or \
                (op is not None and op.rows not in (None, (0,))):
            self.held_ids = None
            return
        if op is not None:
            self.held_ids = self.held_ids[:op.kept(len(self.held_ids))]
        self.held_ids.extend(token_ids.tolist()[0])  # (one torch call: no row view first)

    def chunk_tokens(self, hidden: torch.Tensor) -> int:
        """Tokens per message for this step (see chunking.py): fixed, off (0), or the largest of the hops' sizes."""
        cfg = self.remote.config
        n_tokens = hidden.shape[1]
        if n_tokens == 1 or cfg.prefill_chunk_tokens == 0:
            return n_tokens
        if cfg.prefill_chunk_tokens is not None:
            return min(cfg.prefill_chunk_tokens, n_tokens)
        sizes = []
        for s in self.spans:
            # in the format this link's messages go in (wire/compress.py), not the client's dtype
            wire = self.remote.channels.wire_dtype_for(s.span.address, 4 * hidden.numel())
            bytes_per_token = math.ceil(hidden.shape[0] * hidden.shape[2] * compress.bytes_per_value(wire))
            est = self.remote.channels.bandwidth(s.span.address)
            if est.rtt_s is None and s.span.server_id in self.remote.view.rtt_s:
                est.rtt_s = self.remote.view.rtt_s[s.span.server_id]  # base cost, until a decode step measures it
            profile = self._profile(s.span)
            a, b = profile.prefill_step_terms(s.span.length, hidden.shape[0]) if profile is not None else (0.0, 0.0)
            sizes.append(chunk_tokens_for_hop(cfg.chunk_rule, bytes_per_token, est.bandwidth_bps, a, b))
        return min(max(sizes), n_tokens)

    def _blocking_ok(self, chunks: list[Chunk], hops: list[Hop]) -> bool:
        """Does this step run from the caller's thread (`_step_blocking`)? Every span on a framed stream, the step
        one message: a decode step (pushed or not), or a prompt short enough to go whole on a route not pushed (a
        server that refuses to push a prompt on is noticed there only after the hops' hang bounds). Through the
        loop thread instead, concurrent sessions' prompts each waited for that one thread's turn at the GIL: 8
        sessions started together reached the server one per ~20 ms, and each of their first steps ran in a round
        of its own (docs/RESULTS-packed.md round 10)."""
        if len(chunks) != 1 or not hops:
            return False
        for h in hops:  # (a loop, not all() of a generator: no generator frame per step)
            if not h.stream.blocking_ok:
                return False
        return chunks[0][0].shape[1] == 1 or not self._pushes(hops)

    def _step_blocking(self, record: StepRecord, chunks: list[Chunk], hops: list[Hop], t0: float,
                       padded: bool, relayed: tuple | None = None) -> torch.Tensor:
        """The step from the caller's thread (StepPipeline.run_blocking; `relayed`: what the relay lane's chain did
        of it already); a failover, if it needs one, goes on in the event loop. A step whose hops all went through
        the C chain (relayed, or pushed on a kept route) arms the relay lane for the next."""
        record.blocking = True
        record.pushed = self._pushes(hops)
        chainable = not record.pushed or self.remote.config.keep_routes  # (pushed: on a kept route only)
        relay = self._relay_chain(hops) if chunks[0][0].shape[1] == 1 and chainable else None
        pipeline = StepPipeline(hops, chunks, self.remote.config, self.hang_timeout_s, record.pushed, padded, relay)
        outcome = pipeline.run_blocking(relayed)
        if outcome.complete:
            record.hops.extend(outcome.timings)
            if pipeline.chained:
                self._lane = RelayLane.arm(self, relay, chunks[0][0], record.pushed)
            return self._finish(record, hops, chunks, t0)
        return self.remote.loop.run(self._attempts(record, chunks, hops, t0, outcome, padded))

    def _relay_chain(self, hops: list[Hop]) -> RelayChain | None:
        """The C chain of this route's streams for a relayed decode step (kept while they stay); None without the
        kernels, with ClientConfig.relay_in_c off, or on a stream that cannot take compact frames."""
        streams = [h.stream for h in hops]
        if self._relay is not None and self._relay.fits(streams):
            return self._relay
        self._relay = None
        lib = chain_library() if self.remote.config.relay_in_c else None
        if lib is None or not all(type(s.call) is FrameCall and s.keys is not None for s in streams):
            return None
        self._relay = RelayChain(lib, streams)
        return self._relay

    def _begin(self, hidden: torch.Tensor, mask: torch.Tensor,
               op: CacheOp | None) -> tuple[StepRecord, list[Chunk], list[Hop]]:
        chunks = split(hidden, mask, self.chunk_tokens(hidden))
        record = StepRecord(n_tokens=hidden.shape[1], wall_s=0.0, hops=[], chunks=len(chunks))
        for s in self.spans if op is not None else ():
            s.edit(op)  # what a failover replays from now on (the op itself goes with each span's first chunk)
        return record, chunks, [Hop(s, op=op) for s in self.spans]

    def _pushes(self, hops: list[Hop]) -> bool:
        """Whether this step's route is pushed: ClientConfig.push ("auto": where it pays); never again in a session
        where a server refused to push on."""
        return not self.push_refused and len(hops) > 1 and self.remote.push([h.span for h in hops])

    async def _attempts(self, record: StepRecord, chunks: list[Chunk], hops: list[Hop], t0: float,
                        outcome: AttemptOutcome | None = None, padded: bool = True) -> torch.Tensor:
        """Attempts until every chunk is through every hop (`outcome`: the first one's, run already)."""
        while True:
            if outcome is None:
                record.pushed = self._pushes(hops)
                outcome = await StepPipeline(hops, chunks, self.remote.config, self.hang_timeout_s,
                                             record.pushed, padded).run()
            record.hops.extend(outcome.timings)
            if outcome.complete:
                break
            if outcome.push_refused:
                self._push_refused(record)
            if outcome.stalled:
                self._stalled(outcome, hops, record)
            record.hung.extend(exc.server_id for exc in outcome.failed.values() if isinstance(exc, ServerHung))
            broken = outcome.to_replace()
            f0 = time.perf_counter()
            for i in sorted(broken, reverse=True):  # from the end, so earlier indices stay valid
                hops[i:i + 1] = await replace_hop(self, hops[i], broken[i], record)
                self.spans = [h.open_span for h in hops]
            record.failover_s += time.perf_counter() - f0
            outcome = None
        return self._finish(record, hops, chunks, t0)

    def _finish(self, record: StepRecord, hops: list[Hop], chunks: list[Chunk], t0: float) -> torch.Tensor:
        for h in hops:  # every hop answered every chunk (a loop: no generator frame per step)
            assert len(h.outputs) == len(chunks)
        record.wall_s = time.perf_counter() - t0
        self.steps.append(record)
        return hops[-1].outputs[0] if len(chunks) == 1 else torch.cat(hops[-1].outputs, dim=1)

    def _profile(self, span: Span) -> ComputeProfile | None:
        """The span's server's announced compute profile (None: not announced), built once per record seen."""
        record = self.remote.view.records.get(span.server_id)
        if record is None:
            return None
        seen = self._profiles.get(span.server_id)
        if seen is None or seen[0] is not record:
            seen = self._profiles[span.server_id] = (record, profile_of(record))
        return seen[1]

    def hang_timeout_s(self, span: Span, rows: int, n_tokens: int, cached: bool) -> float:
        """pipeline.hang_timeout_s with this session's config and the span's server's announced profile (a decode
        step's kept while neither changes: the same answer, a handful of calls fewer per hop)."""
        if n_tokens != 1:
            return hang_timeout_s(self.remote.config, self._profile(span), span, rows, n_tokens, cached)
        record = self.remote.view.records.get(span.server_id)
        key = (span.server_id, rows, cached)
        kept = self._decode_bounds.get(key)
        if kept is None or kept[0] is not span or kept[1] is not record:
            bound = hang_timeout_s(self.remote.config, self._profile(span), span, rows, 1, cached)
            kept = self._decode_bounds[key] = (span, record, bound)
        return kept[2]

    def _push_refused(self, record: StepRecord) -> None:
        """A server refused to push on (it does not see the next server announced: that one just moved, or its own
        DHT reads fail): nothing was computed there. The hops from it on are reopened and replayed, and this
        session's steps go without push from now on."""
        if not self.push_refused:
            log.warning("a server refused to push on; this session continues without server-to-server push")
        self.push_refused = record.push_refused = True

    def _stalled(self, outcome: AttemptOutcome, hops: list[Hop], record: StepRecord) -> None:
        """Nothing moved for a whole watchdog_s: every hop not done is reopened and replayed, a bounded number of
        times."""
        record.stalls += 1
        log.warning("step stalled for %.0f s; hops (written, answered, unanswered, link in flight): %s",
                    watchdog_s(self.remote.config),
                    [(h.written, h.answered, h.stream.unanswered, h.stream.link.in_flight) for h in hops])
        if record.stalls > self.remote.config.max_retries:
            stuck = hops[outcome.unsettled[0]]
            raise ServerFailed(stuck.span.server_id, "the step stalled there on every attempt")

    def route_spans(self) -> list[Span]:
        """The route as it is now (after any failover)."""
        return [s.span for s in self.spans]
