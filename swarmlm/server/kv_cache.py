"""The attention-cache layout that lets steps of different sessions run as one forward.

Each session keeps its own keys and values (`SpanCache`) in preallocated buffers that grow by doubling, so a
step writes its new K/V in place instead of concatenating the whole cache. A forward sees the caches through a
`StepCache`, a transformers `Cache` made for that one forward:

- one session: the blocks attend over views of the session's buffers (no copy at all);
- several sessions: each block's K/V are gathered into a batch left-padded to the longest past. The padded
  positions carry 0 in the 2D padding mask, and both families derive everything position-dependent from that
  mask (BLOOM's alibi and Llama's position ids come from its cumulative sum), so a session's real tokens get the
  same positions, biases and attention weights as when it runs alone; masked positions get exactly zero weight.

New K/V are written past a session's committed length and only counted (`commit`) once the whole forward
succeeded: a step that fails leaves every session's cache as it was.

A step's cache op (types.CacheOp) edits a copy: `truncated` shares the buffers with a shorter committed length
(the step then overwrites the cut tail in place: only a retry of the same op, which cuts it again, or a closed
session ever follows a failed one), `selected` gathers the kept rows into new buffers. The session's cache is
replaced by the edited one only when its step succeeds (server/stage.py).

A cache may hold a narrower dtype than the blocks compute in (`SpanCache.dtype`: float16 K/V beside float32 blocks,
half the bytes; server/kv_dtype.py): new K/V are rounded when written, and what a forward reads is widened back to the
blocks' dtype (`StepCache.update`); model/decode_span.py's kernel does both itself.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache


class SpanCache:
    """K/V of one session's blocks: buffers [layers, batch, kv_heads, capacity, head_dim], first `length` valid."""

    def __init__(self, num_layers: int, max_length: int | None = None, dtype: torch.dtype | None = None) -> None:
        self.num_layers = num_layers
        self.max_length = max_length  # growth stops here: the session's cache reservation is for this many tokens
        self.dtype = dtype  # what the buffers hold; None: the dtype of the first K/V written
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = 0  # committed tokens

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[3])

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> int:
        """Place new K/V [B, heads, T, d] of `layer` after the committed tokens; returns the end position."""
        end = self.length + key.shape[2]
        if end > self.capacity:
            self._grow(end, key)
        self.keys[layer, :, :, self.length:end] = key
        self.values[layer, :, :, self.length:end] = value
        return end

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        # [B, heads, end, d]: a view, and B and heads stay mergeable so BLOOM's reshape needs no copy
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

    def commit(self, n_tokens: int) -> None:
        self.length += n_tokens

    def truncated(self, length: int) -> "SpanCache":
        """The first `length` tokens (<= self.length), on the same buffers."""
        assert 0 <= length <= self.length
        cut = SpanCache(self.num_layers, self.max_length, self.dtype)
        if length:
            cut.keys, cut.values, cut.length = self.keys, self.values, length
        return cut

    def selected(self, rows: torch.Tensor) -> "SpanCache":
        """New row i = row rows[i], in new buffers of the same capacity (rows: int64 [B'], may repeat)."""
        picked = SpanCache(self.num_layers, self.max_length, self.dtype)
        picked.length = self.length
        if self.keys is not None:
            # whole rows, capacity included: one contiguous copy per row and layer is faster than gathering only the
            # committed positions (a strided gather into a strided buffer), and what lies past `length` is written
            # before it is read
            picked.keys, picked.values = self.keys.index_select(1, rows), self.values.index_select(1, rows)
        return picked

    @classmethod
    def holding(cls, keys: torch.Tensor, values: torch.Tensor, max_length: int) -> "SpanCache":
        """A cache that holds K/V [layers, B, heads, T, d] (copied: it writes after them, in their dtype), room for
        max_length."""
        n_tokens = int(keys.shape[3])
        cache = cls(int(keys.shape[0]), max_length, keys.dtype)
        cache._grow(min(max(2 * n_tokens, 64), max_length), keys[0, :, :, :1])  # like: [B, heads, 1, d]
        cache.keys[:, :, :, :n_tokens] = keys
        cache.values[:, :, :, :n_tokens] = values
        cache.length = n_tokens
        return cache

    def _grow(self, needed: int, like: torch.Tensor) -> None:
        # doubling keeps appends amortised O(1); the whole old buffer is copied, so K/V that earlier layers of the
        # running step wrote past `length` survive a growth triggered by a later layer
        b, heads, _, d = like.shape
        capacity = max(needed, 2 * self.capacity)
        if self.max_length is not None and needed <= self.max_length:
            capacity = min(capacity, self.max_length)
        if self.dtype is None:
            self.dtype = like.dtype
        keys = like.new_zeros(self.num_layers, b, heads, capacity, d, dtype=self.dtype)
        values = like.new_zeros(self.num_layers, b, heads, capacity, d, dtype=self.dtype)
        if self.keys is not None:
            keys[:, :, :, : self.capacity] = self.keys
            values[:, :, :, : self.capacity] = self.values
        self.keys, self.values = keys, values


@dataclass(frozen=True)
class Member:
    cache: SpanCache
    rows: slice  # this session's rows in the batch


class StepCache(Cache):
    """What the blocks of one forward see as their cache: one or more sessions' SpanCaches, past left-padded to
    `past` tokens. Blocks number their layers from the server's first block; `offset` maps them to the sessions'
    first block (all members run the same sub-range)."""

    def __init__(self, members: list[Member], offset: int) -> None:
        super().__init__(layers=[])  # storage is the members' own; the base class only gets a few queries
        self.members = members
        self.offset = offset
        self.past = max(m.cache.length for m in members)
        self.batch = members[-1].rows.stop

    # ---- what transformers asks the cache --------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = layer_idx - self.offset
        if len(self.members) == 1:
            cache = self.members[0].cache
            end = cache.write(layer, key_states, value_states)
            keys, values = cache.view(layer, end)
            if keys.dtype != key_states.dtype:  # a float16 cache: the blocks attend in their own dtype (a copy)
                return keys.to(key_states.dtype), values.to(value_states.dtype)
            return keys, values
        return self._gather(layer, key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.past

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.past

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.past + query_length, 0  # (kv_length, kv_offset)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    # ---- the batched case ----------------------------------------------------------------------------------
    def _gather(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # key, value: [sum B, heads, T, d] -> [sum B, heads, past + T, d], each session right-aligned at `past`
        t = key.shape[2]
        shape = (self.batch, key.shape[1], self.past + t, key.shape[3])
        keys, values = key.new_empty(shape), value.new_empty(shape)
        for m in self.members:
            end = m.cache.write(layer, key[m.rows], value[m.rows])
            pad = self.past - m.cache.length
            if pad:  # zeros, not garbage: a masked score must stay finite for its zero weight to be exact
                keys[m.rows, :, :pad] = 0
                values[m.rows, :, :pad] = 0
            k, v = m.cache.view(layer, end)
            keys[m.rows, :, pad:] = k
            values[m.rows, :, pad:] = v
        return keys, values


def left_pad(masks: list[torch.Tensor], length: int) -> torch.Tensor:
    """[B_i, L_i] 0/1 masks -> one [sum B_i, length] mask, each right-aligned; the added columns are padding (0)."""
    return torch.cat([torch.nn.functional.pad(m, (length - m.shape[1], 0)) for m in masks], dim=0)
