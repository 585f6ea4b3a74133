"""The client's side of the prefix cache (server/prefix_cache.py, docs/PROTOCOL.md "Prefix cache").

Per span of a route the client names a sequence's leading runs of tokens with chain keys (wire/prefix_keys.py)
salted with what decides the hidden states that server receives: the model, the client's embeddings (dtype and
quantization), the quantization of every upstream block, the wire formats of the links up to it that are not exact,
and the span's first block. Float32 links between full-precision servers leave no trace in the salt, so keys do not
depend on how upstream blocks are split between servers.

Entries are visible to one scope: this client's own random secret, or in a private swarm with `prefix_share`, a
secret every holder of the swarm key derives (members trust each other there).
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
from itertools import groupby
from typing import Callable, Sequence

from swarmlm.config import ClientConfig
from swarmlm.types import Span
from swarmlm.wire.prefix_keys import RUN_TOKENS, chain_keys, scope_digest, tag_of

PREFILL_BYTES = 1 << 20  # the message size whose wire format a span's salt names (prefixes arrive as prefills)


def client_scope(config: ClientConfig) -> bytes:
    if config.prefix_share:  # (config checks that a swarm key comes with it)
        return hmac.new(config.swarm_key, b"swarmlm/prefix-scope", hashlib.sha256).digest()
    return secrets.token_bytes(16)


def span_salts(model_id: str, client_format: str, spans: Sequence[Span], quant_of: Callable[[Span], str],
               wire_of: Callable[[Span], str]) -> list[bytes]:
    """One salt per span of a route, in order."""
    salts, quants, inexact = [], [], []
    for span in spans:
        wire = wire_of(span)
        if wire != "float32":
            inexact.append(f"{span.start}:{wire}")
        runs = ",".join(f"{q}*{len(list(g))}" for q, g in groupby(quants))  # per block, whatever the split
        salts.append(f"{model_id}|{client_format}|{runs}|{' '.join(inexact)}|{span.start}".encode())
        quants.extend([quant_of(span)] * span.length)
    return salts


def keys_for(salt: bytes, token_ids: Sequence[int], leave: int = 0) -> list[bytes]:
    """Keys of the full runs of `token_ids`, leaving at least `leave` tokens after the last run."""
    return chain_keys(salt, token_ids, max(len(token_ids) - leave, 0) // RUN_TOKENS)


def held_runs(scope: bytes, keys: Sequence[bytes], tags: frozenset[str]) -> int:
    """Runs of a sequence a server announces it holds for this scope (its record's tags: runs 1, 2, 4, ... and the
    entries' last), 0 if none."""
    if not tags:
        return 0
    digest = scope_digest(scope)
    return max((j + 1 for j, key in enumerate(keys) if tag_of(digest, key) in tags), default=0)


def announced_held(scope: bytes, model_id: str, client_format: str, prompt: Sequence[int]) -> Callable:
    """record -> the prompt tokens its server announces holding for this scope, for the router. The keys are the
    ones a route of full-precision servers over float32 links gives a span starting at the server's first block
    (other routes' keys differ: then the open finds what it finds, the router just did not foresee it)."""
    by_start: dict[int, list[bytes]] = {}

    def held(record) -> int:
        tags = record.prefix_tag_set
        if not tags:
            return 0
        if record.start not in by_start:
            spans = [Span("", 0, record.start)] if record.start else []
            salt = span_salts(model_id, client_format, [*spans, Span("", record.start, record.end)],
                              lambda s: "none", lambda s: "float32")[-1]
            by_start[record.start] = keys_for(salt, prompt, leave=1)
        return held_runs(scope, by_start[record.start], tags) * RUN_TOKENS

    return held
