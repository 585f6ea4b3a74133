"""The stage: pure compute over this server's blocks. No networking, no bookkeeping beyond a session's cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from swarmlm.model.checkpoint import load_blocks, parse_dtype
from swarmlm.types import BlockRange


class SpanCache(DynamicCache):
    """A DynamicCache for blocks [first, ...) of the server: block modules number layers from the server's first
    block, the cache from the session's first block, so transformers' "past length of layer 0" is right."""

    def __init__(self, offset: int) -> None:
        super().__init__()
        self.offset = offset

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(key_states, value_states, layer_idx - self.offset, *args, **kwargs)


@dataclass
class SpanState:
    """What a session keeps on this server: its sub-range, its cache, and its padding mask so far."""

    blocks: BlockRange
    cache: SpanCache
    mask: torch.Tensor  # [B, position] int64, 1 = real token

    @property
    def position(self) -> int:
        return int(self.mask.shape[1])


class Stage:
    def __init__(self, model_dir: str, blocks: BlockRange, dtype: str = "float32") -> None:
        self.blocks = blocks
        self.dtype = parse_dtype(dtype)
        self.config, self.adapter, self.modules = load_blocks(model_dir, blocks.start, blocks.end, self.dtype)
        self.hidden_size = int(self.config.hidden_size)

    @property
    def kv_dim(self) -> int:
        """Width of one block's key (or value) per token: hidden size, or fewer with grouped-query attention."""
        heads = getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads
        return int(heads * (self.config.hidden_size // self.config.num_attention_heads))

    def cache_bytes(self, num_blocks: int, batch: int, max_length: int) -> int:
        # keys + values for every block, sequence and position the session may reach
        return 2 * num_blocks * batch * max_length * self.kv_dim * self.dtype.itemsize

    def new_state(self, blocks: BlockRange, batch: int) -> SpanState:
        assert self.blocks.contains(blocks)
        return SpanState(blocks, SpanCache(blocks.start - self.blocks.start), torch.zeros(batch, 0, dtype=torch.long))

    @torch.inference_mode()
    def step(self, state: SpanState, hidden: torch.Tensor, new_mask: torch.Tensor) -> torch.Tensor:
        """Run the session's blocks on new tokens; append to its cache and mask. hidden: [B, T, H]."""
        mask = torch.cat([state.mask, new_mask.to(torch.long)], dim=1)
        local = slice(state.blocks.start - self.blocks.start, state.blocks.end - self.blocks.start)
        out = self.adapter.forward_span(
            self.config, self.modules[local], hidden.to(self.dtype), state.cache, mask
        )
        state.mask = mask  # only after success: a failed step leaves the mask as it was
        return out

    @torch.inference_mode()
    def forward(self, blocks: BlockRange, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Stateless forward of whole sequences (no cache kept)."""
        state = self.new_state(blocks, hidden.shape[0])
        return self.step(state, hidden, mask)
