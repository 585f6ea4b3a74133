"""What a server's attention caches hold, and what one cached token costs: the one place that decides both.

`--kv-dtype` (ServerConfig.kv_dtype, config.KV_DTYPE_NAMES): "float32", "float16" or "auto". A float16 cache holds
half the bytes per token (twice the context or sessions in the same --cache-mb) and halves what attention reads per
decode step, which at long contexts is a step's larger read (SmolLM2: past ~1500 positions its float32 K/V outweigh
its packed weights). Keys and values are rounded to float16 when written; attention computes in float32 from them
(kernels/decode.c widens each as it loads it; server/kv_cache.py widens what the transformers path reads).

"auto" = the blocks' compute dtype (float32; bfloat16 blocks keep a bfloat16 cache): float16 is asked for. Measured
(docs/RESULTS-packed.md "Round 13"), SmolLM2's Q4_1 file with float16 K/V against the dequantized float32 reference,
teacher-forced on 32 prompts: logits error 0.044-0.045 % (float32 K/V: 0.016-0.017 %), greedy agreement 99.9-100 %,
within issue 34's goals (<= 1 %, >= 99 %), and a decode step after 2048 positions 1.17x faster. It stays opt-in
because a test that compares a packed SmolLM2 swarm with transformers (tests/test_gguf_smollm2.py: logits within
0.1 % per step) fails with it: float16 K/V put that prompt's steps at 0.04-0.16 % (float32 K/V: 0.01-0.04 %).

Servers announce the resulting dtype beside their blocks' (InfoReply.kv_dtype; swarm/records.py ServerRecord.dtype,
kv_dtype, narrowed_cache): a client with require_full_precision leaves out float16 caches beside float32 blocks.

A session's reservation (server/sessions.py via Stage.cache_bytes), the prefix cache's entries (their tensors' own
bytes) and the announced `session_bytes_per_block_token` (the router's admission estimate) all follow from
`cache_dtype` and `bytes_per_token` here.
"""
from __future__ import annotations

import torch

from swarmlm.config import KV_DTYPE_NAMES

NAMED = {"float32": torch.float32, "float16": torch.float16}


def cache_dtype(kv_dtype: str, compute: torch.dtype) -> torch.dtype:
    """The dtype a server's attention caches hold, given --kv-dtype and the dtype its blocks compute in."""
    if kv_dtype not in KV_DTYPE_NAMES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPE_NAMES)}, got {kv_dtype!r}")
    if kv_dtype == "auto":
        return compute
    if compute != torch.float32:
        # a narrower cache than float32 blocks only: bfloat16 blocks already keep a 2-byte cache of their own dtype
        raise ValueError(f"kv_dtype {kv_dtype!r} needs float32 blocks (dtype float32); these compute in "
                         f"{str(compute).removeprefix('torch.')}: use kv_dtype auto")
    return NAMED[kv_dtype]


def bytes_per_token(kv_dim: int, dtype: torch.dtype) -> int:
    """Cache bytes of one token of one sequence in one block: its key and its value."""
    return 2 * kv_dim * dtype.itemsize
