"""A bounded-memory reference: the logits and greedy tokens of a whole model, computed in one process that holds at
most one dequantized block at a time, so a swarm's output can be checked on a model no machine here can hold.

Each step runs the whole sequence again (no KV cache: the simplest thing that is exactly transformers' forward):
embeddings of the sequence's tokens only (their rows read from the file), then block 0 loaded, run and freed, block
1, ..., the final norm of the last position, and the LM head read and applied in chunks of rows. Blocks are the
project's own (checkpoint.load_blocks: transformers' decoder layers, the family's forward_span), dequantized to
float32 (quant "none": gguf-py's dequantization, not the packed kernels the servers run, so it checks them).
Cost: every step reads and dequantizes every block once (a 2-prompt batch shares the reads); for llama-8b Q4_0 that
is ~0.9 GB float32 per block in memory, the file's 4.6 GB read per step.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import DynamicCache

from swarmlm.model.checkpoint import GGUFTensorIndex, ModelRef, TensorIndex, load_blocks, load_config, tensor_index
from swarmlm.model.families import family_for

HEAD_ROWS = 16384  # LM head rows read at once: 256 MiB of float32 at d_model 4096


@dataclass(frozen=True)
class Generation:
    tokens: torch.Tensor  # [B, steps] greedy tokens after each prompt
    logits: torch.Tensor  # [steps, B, vocab] float32: the last position's logits before each token


class BoundedReference:
    def __init__(self, model: ModelRef, head_rows: int = HEAD_ROWS) -> None:
        self.model, self.head_rows = model, head_rows
        self.config = load_config(model)
        self.adapter = family_for(self.config)
        self.index = tensor_index(model)
        prefix = self.index.stack_prefix(self.adapter)
        self.keys = {name: next(k for k in (c[1:] if c.startswith("/") else prefix + c for c in candidates)
                                if k in self.index.files)
                     for name, candidates in self.adapter.client_tensor_names(self.config).items()}
        small = sorted({k for name, k in self.keys.items() if name not in ("embed.weight", "lm_head.weight")})
        read = self.index.read(small)  # norms (BLOOM's embedding norm too): vectors, kept
        self.norms = {name: read[k].float() for name, k in self.keys.items() if k in small}
        self.largest_block_bytes = 0  # float32 bytes of the largest block held (the one-block bound, measured)

    @torch.inference_mode()
    def last_logits(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids, mask: [B, T] (left padding: mask 0); the logits of the last position: [B, vocab]."""
        hidden = self._embed(ids)  # [B, T, H]
        for i in range(self.config.num_hidden_layers):
            _, _, blocks = load_blocks(self.model, i, i + 1, torch.float32, quant="none")  # dequantized
            self.largest_block_bytes = max(self.largest_block_bytes,
                                           sum(p.nbytes for p in blocks.parameters()))
            hidden = self.adapter.forward_span(self.config, blocks, hidden, DynamicCache(config=self.config), mask)
            del blocks
            gc.collect()  # the block's weights go before the next one comes
        return self._head(hidden[:, -1:])[:, 0]

    def greedy(self, prompts: list[list[int]], steps: int) -> Generation:
        """`steps` greedy tokens after each prompt (left-padded to one batch), no stop at end-of-sequence."""
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        tokens, logits = [], []
        for _ in range(steps):
            last = self.last_logits(ids, mask)
            nxt = last.argmax(-1, keepdim=True)  # [B, 1]
            logits.append(last)
            tokens.append(nxt)
            ids, mask = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
        return Generation(torch.cat(tokens, 1), torch.stack(logits))

    def _client(self, embed: torch.Tensor, head: torch.Tensor):
        """The family's own client modules around a subset of embedding rows and a chunk of head rows."""
        return self.adapter.build_client(self.config, {**self.norms, "embed.weight": embed, "lm_head.weight": head})

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        used = torch.unique(ids)  # only the rows of tokens in the batch
        rows = _read_rows(self.index, self.keys["embed.weight"], used.tolist())
        client = self._client(rows, rows)
        local = torch.searchsorted(used, ids)  # token id -> its row among `used`
        hidden = client.embed(local)
        return client.embed_norm(hidden) if client.embed_norm is not None else hidden

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, 1, H] after the last block -> logits [B, 1, vocab], the head read `head_rows` rows at a time."""
        vocab = int(self.config.vocab_size)
        parts = []
        for start in range(0, vocab, self.head_rows):
            rows = list(range(start, min(vocab, start + self.head_rows)))
            chunk = _read_rows(self.index, self.keys["lm_head.weight"], rows)
            client = self._client(chunk[:1], chunk)
            parts.append(client.lm_head(client.final_norm(hidden)))
            del chunk, client
        return torch.cat(parts, -1)


def _read_rows(index: TensorIndex, key: str, rows: list[int]) -> torch.Tensor:
    """Rows of a 2-D tensor (ascending indices), float32, without reading the rest of it."""
    if isinstance(index, GGUFTensorIndex):
        from gguf import dequantize

        checkpoint = index.gguf
        tensor = checkpoint.tensors[checkpoint.hf_to_gguf[key]]
        data = tensor.data[rows[0]:rows[-1] + 1] if rows == list(range(rows[0], rows[-1] + 1)) else tensor.data[rows]
        values = checkpoint.processor.process(weights=dequantize(data, tensor.tensor_type), name=tensor.name,
                                              tensor_key_mapping={}, parsed_parameters={"tensors": {}}).weights
        return torch.from_numpy(np.array(values, dtype=np.float32, copy=True))
    from safetensors import safe_open

    with safe_open(index.path(key), framework="pt") as f:
        piece = f.get_slice(key)
        if rows == list(range(rows[0], rows[-1] + 1)):
            return piece[rows[0]:rows[-1] + 1].float()
        return torch.cat([piece[r:r + 1] for r in rows]).float()
