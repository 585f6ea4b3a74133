"""The stage: pure compute over this server's blocks. No networking, no bookkeeping beyond a session's cache.

`step` runs one session; `step_batch` runs steps of several sessions (same sub-range, same number of new tokens)
as one forward, each session's result the same as when it runs alone (see swarmlm/server/kv_cache.py) -- to float
rounding (packed weights compute in float32 per row: model/packed.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from swarmlm.kernels.frame_types import AnswerHead, FrameKey
from swarmlm.model.checkpoint import load_blocks, parse_dtype
from swarmlm.model.decode_span import SpanDecoder
from swarmlm.model.packed import packed_types
from swarmlm.model.quant import announced_quant, check_quant, weight_bytes
from swarmlm.model.source import resolve
from swarmlm.server import deep_prompt
from swarmlm.server.adapters import MAX_ADAPTERS, adapter_fingerprint, load_adapter, locate_adapter
from swarmlm.server.kv_cache import Member, SpanCache, StepCache, left_pad
from swarmlm.server.kv_dtype import bytes_per_token, cache_dtype
from swarmlm.server.lora import LoraDelta, lora_hooks
from swarmlm.small_reads import no_padding_mask
from swarmlm.types import BlockRange, CacheOp


@dataclass
class SpanState:
    """What a session keeps on this server: its sub-range, its cache, and its padding mask so far."""

    blocks: BlockRange
    cache: SpanCache
    mask: torch.Tensor  # [B, position] int64, 1 = real token
    lora_adapter: str = ""  # a pre-loaded LoRA adapter the session runs with ("" = none; server/adapters.py)
    prompts: torch.Tensor | None = None  # [blocks, K, H] float32: its deep prompt (server/deep_prompt.py)
    client_lora: tuple[LoraDelta, ...] = ()  # a client's own LoRA on these blocks, sent at open

    @property
    def position(self) -> int:
        return int(self.mask.shape[1])

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    def edited(self, op: CacheOp | None, rows: int) -> "SpanState":
        """The state a step with cache op `op` and `rows` rows starts from; `self` is not changed. An empty state
        takes any number of rows (up to the session's reserved batch: the service checks); positions follow the
        truncation, as every family derives them from the mask."""
        keep = self.position if op is None else op.kept(self.position)
        if keep == 0:
            return SpanState(self.blocks, self.cache.truncated(0), torch.zeros(rows, 0, dtype=torch.long),
                             self.lora_adapter, self.prompts, self.client_lora)
        moved = op is not None and op.rows is not None and op.rows != tuple(range(self.rows))
        if keep == self.position and not moved:
            return self
        cache, mask = self.cache.truncated(keep), self.mask[:, :keep]
        if moved:  # (the identity, frequent in beam search, costs no copy)
            index = torch.tensor(op.rows, dtype=torch.long)
            cache, mask = cache.selected(index), mask[index]
        return SpanState(self.blocks, cache, mask, self.lora_adapter, self.prompts, self.client_lora)


@dataclass(frozen=True)
class StepRequest:
    """One session's step: new tokens' hidden states [B, T, H] and their padding mask [B, T], written after the
    cache op `op` (if any) edits the session's cache."""

    state: SpanState
    hidden: torch.Tensor
    mask: torch.Tensor
    op: CacheOp | None = None

    @property
    def batch_tokens(self) -> int:
        return int(self.hidden.shape[0] * self.hidden.shape[1])  # rows x new tokens: the step's compute size

    @property
    def start(self) -> int:
        """The session position its new tokens take (after the cache op)."""
        return self.state.position if self.op is None else self.op.kept(self.state.position)

    @property
    def prompted(self) -> bool:
        """Does the step write positions of its session's deep prompt?"""
        return deep_prompt.touches(self.state.prompts, self.start)

    @property
    def batch_key(self) -> tuple[int, int, int, str, int]:
        # steps batch together when they run the same blocks on the same number of new tokens, with one adapter;
        # a step writing its session's deep prompt, or of a session with a client's own LoRA, runs alone
        return (self.state.blocks.start, self.state.blocks.end, int(self.hidden.shape[1]), self.state.lora_adapter,
                id(self.state) if self.prompted or self.state.client_lora else 0)


class Stage:
    def __init__(self, model_dir: str, blocks: BlockRange, dtype: str = "float32", quant: str = "auto",
                 mmap: bool = False, kv_dtype: str = "auto") -> None:
        self.blocks = blocks
        self.mmap = mmap  # weights left in the file's mapping (shared, slower; load_blocks)
        self.dtype = parse_dtype(dtype, model_dir)  # "auto": the checkpoint's own (checkpoint.auto_dtype)
        self.quant = check_quant(quant)  # the weights' form in memory (part of the profile's key)
        self.announced_quant = announced_quant(quant, resolve(model_dir).gguf is not None)  # their values' kind
        # packed or quantized block by block as they load (memory follows the packed size), before profiling: the
        # announced speed is that of the weights as held
        self.config, self.adapter, self.modules = load_blocks(
            model_dir, blocks.start, blocks.end, self.dtype, self.quant, mmap)
        self.weight_bytes = weight_bytes(self.modules)  # what the blocks hold in memory (announced)
        self.packed_types = packed_types(self.modules)  # e.g. "Q4_1,Q8_0": the kernels its speed is measured with
        self.kv_dtype = cache_dtype(kv_dtype, self.dtype)  # what the sessions' caches hold (server/kv_dtype.py)
        self.hidden_size = int(self.config.hidden_size)
        self.lora_adapters: dict[str, tuple[LoraDelta, ...]] = {}  # name -> its LoRA on these blocks
        self._decoders: dict[tuple[int, int], SpanDecoder | None] = {}  # local block slice -> its one-call decoder
        self.adapter_versions: dict[str, str] = {}  # name -> its fingerprint (server/adapters.py)

    def load_adapters(self, paths) -> None:
        """Pre-load PEFT LoRA adapters (server/adapters.py) for sessions that ask for them."""
        for ref in paths:
            name, directory = locate_adapter(ref)
            self.lora_adapters[name] = load_adapter(directory, self.modules, self.blocks)
            self.adapter_versions[name] = adapter_fingerprint(directory)
        if len(self.lora_adapters) > MAX_ADAPTERS:
            raise ValueError(f"at most {MAX_ADAPTERS} adapters, got {len(self.lora_adapters)}")

    def release(self) -> None:
        """Drop the weights (a server moving to other blocks frees them before loading the new ones, so it never
        holds both: server/server.py _move). The stage computes nothing afterwards."""
        self.modules = type(self.modules)()
        self._decoders.clear()
        self.lora_adapters.clear()

    @property
    def kv_dim(self) -> int:
        """Width of one block's key (or value) per token: hidden size, or fewer with grouped-query attention (the
        family knows: explicit head_dim in Qwen3 / Gemma 2, Falcon's multi-query)."""
        return self.adapter.kv_dim(self.config)

    def cache_bytes(self, num_blocks: int, batch: int, max_length: int) -> int:
        # keys + values for every block, sequence and position the session may reach
        return num_blocks * batch * max_length * bytes_per_token(self.kv_dim, self.kv_dtype)

    def new_state(self, blocks: BlockRange, batch: int, max_length: int | None = None,
                  lora_adapter: str = "", prompts: torch.Tensor | None = None,
                  client_lora: tuple[LoraDelta, ...] = ()) -> SpanState:
        """max_length: tokens the session may reach, if known: its cache never grows past them. prompts: its deep
        prompt [blocks, K, H], if any; client_lora: a client's own LoRA on these blocks."""
        assert self.blocks.contains(blocks) and (not lora_adapter or lora_adapter in self.lora_adapters)
        assert prompts is None or prompts.shape[0] == blocks.length
        return SpanState(blocks, SpanCache(blocks.length, max_length, self.kv_dtype),
                         torch.zeros(batch, 0, dtype=torch.long),
                         lora_adapter, prompts, client_lora)

    def step(self, state: SpanState, hidden: torch.Tensor, new_mask: torch.Tensor,
             op: CacheOp | None = None) -> torch.Tensor:
        """Run the session's blocks on new tokens after `op`; append to its cache and mask. hidden: [B, T, H]."""
        return self.step_batch([StepRequest(state, hidden, new_mask, op)])[0]

    def step_batch(self, requests: list[StepRequest]) -> list[torch.Tensor]:
        """Run several sessions' steps as one forward; outputs in request order, each [B_i, T, H].

        All requests run the same sub-range on the same number of new tokens (equal `batch_key`), each session at
        most once. Caches and masks (cache ops included) change only if the whole forward succeeds. No gradients:
        transformers' forward runs in inference mode; the one-call decoder takes no tensor that wants them and needs
        no mode (entering it cost a decode step 25-30 us with its code out of the CPU's caches: docs/RESULTS-hop.md
        round 15)."""
        first = requests[0]
        if len(requests) > 1:
            assert all(r.batch_key == first.batch_key for r in requests), "only steps with equal batch_key batch"
            assert len({id(r.state) for r in requests}) == len(requests), "a session appears twice in one batch"
        starts = [r.state.edited(r.op, int(r.hidden.shape[0])) for r in requests]
        assert all(s.rows == r.hidden.shape[0] for s, r in zip(starts, requests)), "rows checked by the service"
        masks = [torch.cat([s.mask, r.mask if r.mask.dtype == torch.long else r.mask.to(torch.long)], dim=1)
                 for s, r in zip(starts, requests)]
        members, row = [], 0  # (the session's edited cache, its rows in the batch)
        for s, r in zip(starts, requests):
            members.append((s.cache, slice(row, row + r.hidden.shape[0])))
            row += r.hidden.shape[0]
        t = first.hidden.shape[1]
        # (one session: its own tensor, not a copy: the decoder copies it, transformers' blocks do not write into it)
        hidden = first.hidden if len(requests) == 1 else torch.cat([r.hidden for r in requests], dim=0)  # [sum B, T, H]
        local = slice(first.state.blocks.start - self.blocks.start, first.state.blocks.end - self.blocks.start)
        decoder = self._decoder_of(first.state, first.prompted, local)
        out = None
        if decoder is not None and decoder.usable(hidden):  # one kernel call (model/decode_span.py), or None
            out = decoder.step(hidden, members, masks)
        if out is None:
            out = self._forward(requests, starts, members, masks, hidden.to(self.dtype), local)
        # only after success: a failed forward leaves every session's committed length and mask as they were
        for (cache, _), r, m in zip(members, requests, masks):
            cache.commit(t)
            r.state.cache, r.state.mask = cache, m
        return [out] if len(requests) == 1 else [out[rows] for _, rows in members]

    @torch.inference_mode()
    def _forward(self, requests: list[StepRequest], starts: list[SpanState], members: list, masks: list[torch.Tensor],
                 hidden: torch.Tensor, local: slice) -> torch.Tensor:
        """The steps through transformers' forward of the blocks (with the session's adapters and deep prompt);
        writes the new K/V past the caches' committed lengths (the caller commits)."""
        first, t = requests[0], hidden.shape[1]
        cache = StepCache([Member(c, rows) for c, rows in members], offset=first.state.blocks.start - self.blocks.start)
        mask = masks[0] if len(requests) == 1 else left_pad(masks, cache.past + t)  # [sum B, past + T]
        prompt = deep_prompt.prompt_hooks(self.modules[local], first.state.prompts, starts[0].position) \
            if first.prompted else contextlib.nullcontext()  # (a prompted step runs alone: batch_key)
        deltas = (*self.lora_adapters.get(first.state.lora_adapter, ()), *first.state.client_lora)
        with lora_hooks(self.modules, self.blocks.start, deltas), prompt:
            return self.adapter.forward_span(self.config, self.modules[local], hidden, cache, mask)

    def plain_decoder(self, state: SpanState, rows: int) -> SpanDecoder | None:
        """The one-call decoder that computes a plain decode step (`rows` rows, one new token each, no padding, no
        cache op) of session `state` exactly as `step` would (the rule `step_batch` applies), for `answer_step`; None
        when `step` must run it (its blocks, adapters or deep prompt need transformers, too many rows, or a first
        step: its state starts then)."""
        if not state.position or rows != state.rows:
            return None
        local = slice(state.blocks.start - self.blocks.start, state.blocks.end - self.blocks.start)
        decoder = self._decoder_of(state, deep_prompt.touches(state.prompts, state.position), local)
        return decoder if decoder is not None and decoder.fits(rows) else None

    def answer_step(self, decoder: SpanDecoder, state: SpanState, body: bytes, rows: int, key: FrameKey,
                    head: AnswerHead) -> memoryview | None:
        """`step` of a plain decode step whose `plain_decoder` is `decoder`, from a compact STEP's `body` straight to
        its whole ANSWER frame (SpanDecoder.answer: values checked finite, the span, the frame under `key` with header
        `head`); the session's cache and mask commit as `step`'s do. None (nothing committed) if a value is NaN or
        infinite."""
        mask = torch.cat([state.mask, no_padding_mask(rows, 1)], dim=1)  # (as step_batch's)
        frame = decoder.answer(body, rows, [(state.cache, slice(0, rows))], [mask], key, head)
        if frame is not None:  # only after success, as in step_batch
            state.cache.commit(1)
            state.mask = mask
        return frame

    def _decoder_of(self, state: SpanState, prompted: bool, local: slice) -> SpanDecoder | None:
        """The one-call decoder for a step of `state` on the local blocks `local` (`prompted`: it writes positions of
        the session's deep prompt), or None when its adapters or prompt need transformers' forward."""
        if state.lora_adapter or state.client_lora or prompted:
            return None
        return self._span_decoder(local)

    def _span_decoder(self, local: slice) -> SpanDecoder | None:
        key = (local.start, local.stop)
        if key not in self._decoders:
            self._decoders[key] = SpanDecoder.of(self.config, self.adapter, self.modules[local], self.dtype,
                                                 self.kv_dtype)
        return self._decoders[key]

    def forward(self, blocks: BlockRange, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Stateless forward of whole sequences (no cache kept)."""
        state = self.new_state(blocks, hidden.shape[0])
        return self.step(state, hidden, mask)
