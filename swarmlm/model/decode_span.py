"""A decode step (or a few new tokens) of a span of packed Llama-shaped blocks in one kernel call (kernels/decode.c).

A server's step of one new token per row through its blocks costs, in transformers, ~30 torch operations and module
calls per block (SmolLM2: ~250 us a block against ~400 us of weight reads). `SpanDecoder` runs the same arithmetic
(RMSNorm, packed q/k/v products, rotary embedding, the new K/V written into the rows' caches, attention over their
unmasked positions, output product, SiLU-gated MLP, residuals) in one C call per step, in float32, to float32
summation order of the blocks' own forward.

It takes a span only when that is exactly what the blocks compute (`SpanDecoder.of`): Llama, Mistral, Qwen2 or Qwen3 blocks
whose seven products are all packed (a GGUF's own blocks, or --quant int8/int4), SiLU, RMSNorm, full or sliding-window
attention (config.sliding_window on the layers the family marks sliding), float32; and a step only when it has at
most DIRECT_ROWS new tokens in all (`usable`: decode steps, speculative passes, short prompts), every one real (the
kernel refuses a padding query: `step` returns None). Anything else -- other families, float weights, LoRA adapters,
long prompts, gradients, padding queries -- runs through transformers as before (server/stage.py decides per step).

Each call's own cost is kept small, as every server pays it once per token with its caches cold (docs/RESULTS-hop.md
rounds 15-16): two torch ops (the input's copy, which the kernel works on in place; the caller's mask
concatenation), the per-row arrays kept while the caches stay (a step writes its lengths and mask rows into them),
the rotary positions counted by the kernel from the masks.
"""
from __future__ import annotations

import ctypes

import torch
from torch import nn

from swarmlm.kernels import library
from swarmlm.kernels.frame_types import AnswerHead, FrameKey
from swarmlm.kernels.frame_types import ANSWER_OVERHEAD, STEP_HEAD
from swarmlm.kernels.lane import NOT_FINITE
from swarmlm.model.families.base import SLIDING
from swarmlm.model.packed import DIRECT_ROWS, THREADED_MIN_WEIGHTS, PackedLinear, PackedError, threaded_library

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
PRODUCTS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
            ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))




class _Linear(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int64), ("w", ctypes.c_void_p), ("row_bytes", ctypes.c_int64),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("bias", ctypes.c_void_p)]


class _Block(ctypes.Structure):
    _fields_ = [(name, _Linear) for name in ("q", "k", "v", "o", "gate", "up", "down")] + [
        ("norm_in", ctypes.c_void_p), ("norm_post", ctypes.c_void_p), ("window", ctypes.c_int64),
        ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p)]


class _Dims(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("inter", ctypes.c_int64), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("min_weights", ctypes.c_int64), ("kv_half", ctypes.c_int64)]


class SpanDecoder:
    """One decode step (one new token per row) through `blocks` in one kernel call."""

    def __init__(self, config, rotary: nn.Module, blocks: nn.ModuleList, kv_dtype: torch.dtype = torch.float32) -> None:
        first = blocks[0]
        attn = first.self_attn
        self.rotary = rotary
        self.head_dim = int(attn.head_dim)
        self.kv_heads = int(config.num_key_value_heads or config.num_attention_heads)
        self.dims = _Dims(int(config.hidden_size), int(config.num_attention_heads), self.kv_heads, self.head_dim,
                          int(first.mlp.gate_proj.out_features), float(first.input_layernorm.variance_epsilon),
                          float(attn.scaling), THREADED_MIN_WEIGHTS, int(kv_dtype == torch.float16))
        self.kv_dtype = kv_dtype  # the sessions' caches: float32, or float16 (rounded when written, widened when read)
        window = int(getattr(config, "sliding_window", None) or 0)
        self.blocks = (_Block * len(blocks))(*[_block(b, window if b.swarmlm_layer_type == SLIDING else 0)
                                               for b in blocks])
        self._held = list(blocks)  # the weights' tensors stay alive as long as the pointers above
        rope = getattr(rotary, "rope_type", "default")
        self._table_ok = "dynamic" not in rope and rope != "longrope"  # frequencies fixed: cos/sin from a table
        self._table = torch.empty(2, 0, self.head_dim)  # [cos, sin] x positions x head_dim, float32
        self._last_rows = None  # (key, arrays): the last step's per-row cache pointers (_cache_rows)
        self._dims = ctypes.byref(self.dims)
        # a plain decode step's rows and its ANSWER frame (`answer`), made once: the kernel works in them
        self._work = torch.empty(DIRECT_ROWS, 1, self.dims.hidden)
        self._frame = bytearray(ANSWER_OVERHEAD + 4 * DIRECT_ROWS * self.dims.hidden)
        self._frame_view = memoryview(self._frame)
        self._frame_at = ctypes.addressof((ctypes.c_char * len(self._frame)).from_buffer(self._frame))

    @classmethod
    def of(cls, config, adapter, blocks: nn.ModuleList, dtype: torch.dtype,
           kv_dtype: torch.dtype = torch.float32) -> "SpanDecoder | None":
        """The decoder for this span, or None if its blocks are not exactly what decode.c computes (kv_dtype: the
        sessions' caches, float32 or float16)."""
        if adapter.name not in FAMILIES or dtype != torch.float32 or not len(blocks):
            return None
        if kv_dtype not in (torch.float32, torch.float16):
            return None
        if getattr(config, "hidden_act", None) != "silu" or getattr(config, "pretraining_tp", 1) not in (1, None):
            return None
        for block in blocks:
            if block.swarmlm_layer_type == SLIDING and not getattr(config, "sliding_window", None):
                return None
            for part, name in PRODUCTS:
                linear = getattr(getattr(block, part, None), name, None)
                if not isinstance(linear, PackedLinear) or linear.softcap is not None:
                    return None
            for norm in _norms(block):
                if norm.weight.dtype != torch.float32 or norm.variance_epsilon != config.rms_norm_eps:
                    return None
        try:
            library()
        except Exception:  # noqa: BLE001 (no compiler: the blocks still run through transformers)
            return None
        return cls(config, adapter.rotary(config), blocks, kv_dtype)

    def usable(self, hidden: torch.Tensor) -> bool:
        """At most DIRECT_ROWS new tokens in all (rows x tokens: decode steps, speculative passes, short prompts), and
        no gradients wanted for them. (A step with a padding query is refused by `step` itself: the kernel reads the
        masks anyway.)"""
        wanted = hidden.requires_grad and torch.is_grad_enabled()
        return self.fits(hidden.shape[0] * hidden.shape[1]) and not wanted

    @staticmethod
    def fits(tokens: int) -> bool:
        """Does a step of `tokens` new tokens in all (rows x tokens) fit one call?"""
        return tokens <= DIRECT_ROWS

    def step(self, hidden: torch.Tensor, members, masks: list[torch.Tensor]) -> torch.Tensor | None:
        """hidden [B, T, H]; members: (SpanCache, rows slice) per session, each cache's committed length + T equal to
        its mask's width; the new K/V are written past the committed length (counted by the caller's commit).
        Returns the span's output [B, T, H] float32 (the blocks' dtype), or None if a new token is padding (a padding
        query is transformers' business: nothing was computed, no cache written).

        The kernel sees B x T query rows, a sequence's tokens in order: token t of a row is written at position
        length + t and attends to positions up to its own (causal), through the row's mask; its rotary position is
        the kernel's to count from the same mask (the real tokens up to its own - 1, as transformers derives it)."""
        n_tokens = hidden.shape[1]
        # the kernel works in place on a float32 copy: [B, T, H] contiguous is its [B x T, H] (the caller's tensor
        # stays as it was); a clone when it is float32 already (half of `to`'s cost). (An empty output the kernel
        # copies the input into measured no cheaper cold: docs/RESULTS-hop.md round 16.)
        x = hidden.clone(memory_format=torch.contiguous_format) if hidden.dtype == torch.float32 else \
            hidden.to(torch.float32, memory_format=torch.contiguous_format)
        rows, keep = self._prepare(x, members, masks, n_tokens)
        code = threaded_library().decode_span(self._dims, self.blocks, len(self.blocks), x.data_ptr(), *rows)
        if code == -3:
            return None
        if code != 0:
            raise PackedError(f"the decode kernel refused the step (code {code})")
        return x

    def answer(self, body: bytes, rows: int, members, masks: list[torch.Tensor], key: FrameKey,
               head: AnswerHead) -> memoryview | None:
        """A plain decode step (one new token per row, `rows` rows) of a compact STEP, answered in one call
        (kernels/lane.c): `body` the STEP's body (its rows x H float32 after its header, length checked), its values
        checked finite, copied into the decoder's work rows and run as `step` runs them (the same caches, lengths,
        masks and rotary rows: `_prepare`); then the whole ANSWER frame under `key`, its header `head` (the kernel
        sets compute_s and encode_s, adds its own parse time to parse_s). Returns the frame (a view of the decoder's
        frame buffer, until its next `answer`), or None if a value is NaN or infinite (nothing computed, no cache
        written; a cache may have grown). The caller commits; one `answer` at a time (the scheduler's inline slot)."""
        assert rows <= DIRECT_ROWS
        x = self._work[:rows]  # [rows, 1, H]: the kernel's rows, then the answer's values
        prepared, keep = self._prepare(x, members, masks, 1)
        size = threaded_library().lane_decode_answer(
            self._dims, self.blocks, len(self.blocks), self.dims.hidden, body, STEP_HEAD, x.data_ptr(),
            *prepared, key, head, self._frame_at)
        if size == NOT_FINITE:
            return None
        if size < 0:
            raise PackedError(f"the decode kernel refused the step (code {size})")
        return self._frame_view[:size]

    def _prepare(self, x: torch.Tensor, members, masks: list[torch.Tensor], n_tokens: int) -> tuple[tuple, list]:
        """What the kernel takes after the work rows `x` [B, T, H]: the query rows, their cache pointers, layer
        strides, capacities, lengths and mask rows, the rotary table and its kind (decode.c `decode_span`); and the
        int64 masks those rows point into (alive until the kernel returns). Caches that are too short grow first
        (the rows' pointers follow them)."""
        widest = 0
        for (cache, span), mask in zip(members, masks):  # growth first: the rows' cache pointers follow it
            end = cache.length + n_tokens
            assert mask.shape == (span.stop - span.start, end), "a mask covers the committed tokens and the new ones"
            assert cache.dtype == self.kv_dtype, "the kernel reads caches of the decoder's kv_dtype"
            if end > cache.capacity:
                cache._grow(end, x.new_empty(span.stop - span.start, self.kv_heads, 1, self.head_dim))
            widest = max(widest, end)
        keys, values, strides, caps, lengths, mask_rows = self._cache_rows(members, n_tokens)
        keep, q = [], 0
        for (cache, span), mask in zip(members, masks):  # this step's lengths and mask rows, per query row
            m = mask if mask.dtype == torch.int64 and mask.is_contiguous() else mask.to(torch.int64).contiguous()
            keep.append(m)  # (alive until the kernel returns: it reads the rows through their addresses)
            row, row_bytes = m.data_ptr(), 8 * m.stride(0)
            for _ in range(span.stop - span.start):
                for t in range(n_tokens):  # token t of a row: written at length + t
                    lengths[q], mask_rows[q] = cache.length + t, row
                    q += 1
                row += row_bytes
        rope, by_row = self._rope(x, keep, n_tokens, widest)
        keep.append(rope)  # (a table made for this step only: alive until the kernel returns)
        return (q, keys, values, strides, caps, lengths, mask_rows, rope.data_ptr(), rope.shape[1], by_row), keep

    @property
    def has_rope_table(self) -> bool:
        """Are this rotary's values a table of positions (not dynamic, not longrope)?"""
        return self._table_ok

    def rope_table(self, x: torch.Tensor, positions: int) -> torch.Tensor:
        """The rotary table [2, L >= positions, head_dim] the kernel reads (`_rope`'s; `has_rope_table` only). `x`:
        any float32 [B, H] (the rotary's dtype)."""
        assert self._table_ok
        return self._rope(x.view(x.shape[0], 1, -1), [], 1, positions)[0]

    def _cache_rows(self, members, n_tokens: int) -> tuple:
        """Per query row: its cache's K and V pointers for the span's first block, layer stride and capacity, and
        two arrays for the step to fill (its length and mask row: `step`), all ctypes int64 arrays. The first four
        change only when a cache grows or the batch changes, so the last step's arrays are kept (made again, a cold
        step paid ~20 us more for two small arrays). The arrays a step fills are shared by the steps of one key:
        the same caches' buffers, that is one session's, whose steps never run at once."""
        key = (n_tokens, *[(c.keys.data_ptr(), c.values.data_ptr(), c.capacity, s.stop - s.start) for c, s in members])
        last = self._last_rows  # (read once: the I/O loop's inline decode and the compute thread share this decoder)
        if last is None or last[0] != key:
            keys, values, strides, caps = [], [], [], []
            for cache, span in members:
                assert cache.keys.is_contiguous() and cache.values.is_contiguous()
                n = span.stop - span.start
                layer_stride = n * self.kv_heads * cache.capacity * self.head_dim
                row_bytes = cache.keys.stride(1) * cache.keys.element_size()
                for j in range(n):
                    keys += [cache.keys.data_ptr() + j * row_bytes] * n_tokens
                    values += [cache.values.data_ptr() + j * row_bytes] * n_tokens
                    strides += [layer_stride] * n_tokens
                    caps += [cache.capacity] * n_tokens
            longs = ctypes.c_int64 * len(keys)
            last = self._last_rows = key, (longs(*keys), longs(*values), longs(*strides), longs(*caps), longs(), longs())
        return last[1]

    def _rope(self, x: torch.Tensor, masks: list[torch.Tensor], n_tokens: int, widest: int) -> tuple[torch.Tensor, int]:
        """cos and sin [2, L, head_dim] for the kernel, and whether row r takes table row r (1) or the row of its
        position (0; every position < widest). A table of the rotary module's own values by position (its forward
        is elementwise in the position), grown by doubling; a rotary whose frequencies depend on the positions seen
        (dynamic, longrope) is asked every step for the rows' own positions."""
        if self._table_ok:
            table = self._table
            if widest > table.shape[1]:
                grown = torch.arange(max(widest, 2 * table.shape[1], 256))[None]
                cos, sin = self.rotary(x.view(-1, x.shape[-1])[:1, None], position_ids=grown)  # [1, L, head_dim]
                table = self._table = torch.stack([cos[0], sin[0]]).float().contiguous()  # [2, L, head_dim]
            return table, 0
        # every new token is real (else the kernel refuses the step): token t of a row sits at (the row's real
        # tokens) - T + t, the position transformers derives from a left-padding mask (families/base.py
        # padded_positions)
        first = torch.cat([m.sum(1) for m in masks]).sub_(n_tokens)  # [B]
        positions = (first[:, None] + torch.arange(n_tokens)).reshape(-1)  # [B x T]
        rows = x.reshape(len(positions), 1, -1)
        cos, sin = self.rotary(rows, position_ids=positions[:, None])
        return torch.stack([cos.reshape(len(rows), -1), sin.reshape(len(rows), -1)]).float().contiguous(), 1


def _linear(module: PackedLinear) -> _Linear:
    bias = module.bias
    if bias is not None:
        assert bias.dtype == torch.float32 and bias.is_contiguous()
    p = module.packed
    return _Linear(p.ggml_type, p.data.data_ptr(), p.data.shape[1], p.rows, p.cols,
                   None if bias is None else bias.data_ptr())


def _norms(block: nn.Module) -> list[nn.Module]:
    """The block's RMSNorms: around attention and MLP, and Qwen3's per-head query and key norms."""
    extra = [getattr(block.self_attn, name) for name in ("q_norm", "k_norm") if hasattr(block.self_attn, name)]
    return [block.input_layernorm, block.post_attention_layernorm, *extra]


def _block(block: nn.Module, window: int) -> _Block:
    linears = [_linear(getattr(getattr(block, part), name)) for part, name in PRODUCTS]
    norms = [norm.weight.data_ptr() for norm in (block.input_layernorm, block.post_attention_layernorm)]
    qk = [getattr(block.self_attn, name, None) for name in ("q_norm", "k_norm")]
    return _Block(*linears, *norms, window, *[None if n is None else n.weight.data_ptr() for n in qk])
