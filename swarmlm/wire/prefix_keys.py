"""Prefix-cache keys (docs/PROTOCOL.md, "Prefix cache"): what a client computes and a server only compares.

key[j] = H(key[j-1] || ids of run j) with key[-1] = H(salt): a hash chain over runs of RUN_TOKENS token ids, so
key[j] names the first (j + 1) runs and nothing else. The salt carries everything that changes the hidden states a
server receives for those tokens (client/prefix.py). H = SHA-256 cut to KEY_BYTES.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Sequence

RUN_TOKENS = 16  # tokens per key: finer finds longer matches, coarser sends fewer keys (16 B per run)
KEY_BYTES = 16
TAG_HEX = 16  # hex characters of an announced tag


def chain_keys(salt: bytes, token_ids: Sequence[int], runs: int) -> list[bytes]:
    """The keys of the first `runs` full runs of `token_ids` (fewer if it has fewer)."""
    runs = min(runs, len(token_ids) // RUN_TOKENS)
    key, keys = hashlib.sha256(b"swarmlm/prefix-v1" + salt).digest()[:KEY_BYTES], []
    for j in range(runs):
        run = token_ids[j * RUN_TOKENS:(j + 1) * RUN_TOKENS]
        key = hashlib.sha256(key + struct.pack(f"<{RUN_TOKENS}q", *run)).digest()[:KEY_BYTES]
        keys.append(key)
    return keys


def scope_digest(scope: bytes) -> bytes:
    """What a server stores of a scope token (entries of one scope are visible to its holders only)."""
    return hashlib.sha256(b"swarmlm/prefix-scope" + scope).digest()


def tag_of(digest: bytes, key: bytes) -> str:
    """What a server's record announces for a key: only a holder of the scope can match it (a key itself, a hash of
    guessable prompts, would tell every reader which prompts a client sent)."""
    return hashlib.sha256(digest + key).hexdigest()[:TAG_HEX]
