"""Prompt caches that outlive a session: K/V rows of finished sessions' prefixes, found by a client-computed key.

A client names the first j+1 runs of RUN_TOKENS tokens of a sequence with a chain key (wire/prefix_keys.py: a hash
chain over the token ids, salted with everything that changes the hidden states this server receives). A session
asks to keep its prefix (`PrefixSave`): its K/V rows for len(keys) runs are copied out into an entry, registered
under every key of the chain, so a later session whose prompt shares only the first runs still finds it. A new
session names its prompt's keys at open and starts from the longest one found.

A server cannot check a key against the tokens behind it, so entries belong to a scope (the opener's secret
token, stored as its digest): a lookup sees only its own scope's entries (docs/PROTOCOL.md, "Prefix cache").

Entries count in the server's cache budget beside the sessions' reservations and are evicted least recently used;
a live session's reservation always wins (SessionTable.reserve evicts entries to make room, never the reverse).
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch

from swarmlm.errors import CapacityExceeded, InvalidRequest
from swarmlm.server.kv_cache import SpanCache
from swarmlm.types import BlockRange
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire.prefix_keys import KEY_BYTES, RUN_TOKENS, scope_digest, tag_of

MAX_KEYS = 4096  # 64k tokens: more than any session holds
SCOPE_BYTES = (16, 64)  # a scope token's accepted length
MAX_TAGS = 64  # tags announced in the server's record (16 hex characters each)
# a scope holding more than this share of the entries' budget pays for its own saves: when room must be made, its own
# least recently used entries give way before anyone else's, so one client (or gateway user) cannot evict everybody
# else's prefixes; a scope alone may still use the whole budget
SCOPE_SHARE = 0.25


def tag_runs(n: int) -> list[int]:
    """Run counts whose keys an entry of n runs announces: 1, 2, 4, ... and n (a prompt sharing a shorter prefix
    is still seen at a power of two below its length)."""
    return sorted({*(1 << i for i in range(n.bit_length()) if 1 << i <= n), n})


def check_keys(keys, what: str) -> tuple[bytes, ...]:
    if len(keys) > MAX_KEYS:
        raise InvalidRequest(f"{what}: {len(keys)} keys exceed the limit of {MAX_KEYS}")
    if any(len(k) != KEY_BYTES for k in keys):
        raise InvalidRequest(f"{what}: every key must be {KEY_BYTES} bytes")
    return tuple(bytes(k) for k in keys)


def check_scope(scope: bytes) -> bytes:
    if not SCOPE_BYTES[0] <= len(scope) <= SCOPE_BYTES[1]:
        raise InvalidRequest(f"prefix_scope must be {SCOPE_BYTES[0]}-{SCOPE_BYTES[1]} bytes, got {len(scope)}")
    return scope_digest(scope)


@dataclass
class Entry:
    digest: bytes  # the owning scope's digest
    blocks: BlockRange
    keys: tuple[bytes, ...]  # keys[j] covers the first (j + 1) * RUN_TOKENS tokens
    keys_t: torch.Tensor  # [layers, 1, kv_heads, tokens, head_dim], compact (no spare capacity)
    values_t: torch.Tensor

    @property
    def nbytes(self) -> int:
        return 2 * self.keys_t.numel() * self.keys_t.element_size()


@dataclass
class PrefixStats:
    hits: int = 0  # opens that started from an entry
    hit_tokens: int = 0
    evictions: int = 0
    saves: int = 0
    refused: int = 0  # saves that did not fit the budget


class PrefixCache:
    """Entries by (scope digest, blocks, key), least recently used first. `limit_bytes` caps the entries; the room
    a save may take is also bounded by the caller (what the sessions' reservations leave of the cache budget)."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # serial -> entry, LRU first
        self.index: dict[tuple, tuple[int, int]] = {}  # (digest, start, end, key) -> (serial, runs)
        # every entry holding each index key (serial -> runs, oldest first): an eviction re-points the index to
        # another holder in O(1) per key, never by scanning the other entries
        self.holders: dict[tuple, dict[int, int]] = {}
        self.scope_bytes: dict[bytes, int] = {}  # bytes held per scope digest (SCOPE_SHARE)
        self.scope_order: dict[bytes, OrderedDict[int, None]] = {}  # each scope's serials, LRU first
        self.bytes = 0
        self.stats = PrefixStats()
        self._serials = itertools.count()

    def lookup(self, digest: bytes, blocks: BlockRange, keys: tuple[bytes, ...]) -> tuple[Entry, int] | None:
        """The entry holding the longest prefix among `keys` for this scope and blocks, and its runs; None: none."""
        for j in range(len(keys) - 1, -1, -1):
            found = self.index.get((digest, blocks.start, blocks.end, keys[j]))
            if found is not None:
                serial, runs = found
                self._touch(serial)
                return self.entries[serial], runs
        return None

    def restore(self, entry: Entry, runs: int, max_length: int) -> tuple[SpanCache, torch.Tensor]:
        """A session's cache holding the entry's first `runs` runs (a copy: the session writes after them) and its
        padding mask."""
        n_tokens = runs * RUN_TOKENS
        cache = SpanCache.holding(entry.keys_t[:, :, :, :n_tokens], entry.values_t[:, :, :, :n_tokens], max_length)
        self.stats.hits += 1
        self.stats.hit_tokens += n_tokens
        return cache, torch.ones(1, n_tokens, dtype=torch.long)

    def save(self, digest: bytes, blocks: BlockRange, keys: tuple[bytes, ...], cache: SpanCache,
             room_bytes: int) -> bool:
        """Keep the first len(keys) runs of `cache` (one row) under `keys`; evicts older entries to fit within
        min(limit, room_bytes). False: it does not fit (nothing changes)."""
        if not keys or cache.keys is None:
            return False
        if (digest, blocks.start, blocks.end, keys[-1]) in self.index:  # already held: just touch it
            self._touch(self.index[(digest, blocks.start, blocks.end, keys[-1])][0])
            return True
        n_tokens = len(keys) * RUN_TOKENS
        nbytes = 2 * cache.keys[:, :, :, :n_tokens].numel() * cache.keys.element_size()
        budget = min(self.limit_bytes, room_bytes)
        if nbytes > budget:
            self.stats.refused += 1
            return False
        need = self.bytes + nbytes - budget  # what must be evicted for this save
        if need > 0 and self.scope_bytes.get(digest, 0) + nbytes > SCOPE_SHARE * self.limit_bytes:
            self._shrink_scope(digest, self.scope_bytes[digest] - need)  # a scope past its share pays first
        self.shrink_to(budget - nbytes)
        kept = (cache.keys[:, :, :, :n_tokens].clone(), cache.values[:, :, :, :n_tokens].clone())  # compact copies
        entry = Entry(digest, blocks, keys, *kept)
        serial = next(self._serials)
        self.entries[serial] = entry
        for j, key in enumerate(keys):  # a shorter prefix stays with the entry that already holds it
            index_key = (digest, blocks.start, blocks.end, key)
            self.index.setdefault(index_key, (serial, j + 1))
            self.holders.setdefault(index_key, {})[serial] = j + 1
        self.bytes += entry.nbytes
        self.scope_bytes[digest] = self.scope_bytes.get(digest, 0) + entry.nbytes
        self.scope_order.setdefault(digest, OrderedDict())[serial] = None
        self.stats.saves += 1
        return True

    def shrink_to(self, nbytes: int) -> None:
        """Evict least recently used entries until at most `nbytes` are held."""
        while self.entries and self.bytes > max(nbytes, 0):
            serial = next(iter(self.entries))
            self._evict(serial)

    def _shrink_scope(self, digest: bytes, nbytes: float) -> None:
        """Evict the scope's own least recently used entries until it holds at most `nbytes`."""
        while self.scope_bytes.get(digest, 0) > max(nbytes, 0):
            self._evict(next(iter(self.scope_order[digest])))

    def _touch(self, serial: int) -> None:
        self.entries.move_to_end(serial)
        self.scope_order[self.entries[serial].digest].move_to_end(serial)

    def _evict(self, serial: int) -> None:
        """Drop one entry; each index key it answered for goes to another entry holding that prefix, if any:
        O(its keys)."""
        entry = self.entries.pop(serial)
        self.bytes -= entry.nbytes
        self.scope_bytes[entry.digest] -= entry.nbytes
        del self.scope_order[entry.digest][serial]
        if not self.scope_order[entry.digest]:
            del self.scope_bytes[entry.digest], self.scope_order[entry.digest]
        self.stats.evictions += 1
        for key in entry.keys:
            index_key = (entry.digest, entry.blocks.start, entry.blocks.end, key)
            holders = self.holders[index_key]
            del holders[serial]
            if not holders:
                del self.holders[index_key]
                self.index.pop(index_key, None)
            elif self.index[index_key][0] == serial:
                other = next(iter(holders))
                self.index[index_key] = (other, holders[other])

    def tags(self) -> list[str]:
        """The most recently used entries' keys at runs 1, 2, 4, ... and their last, as tags (at most MAX_TAGS)."""
        out: list[str] = []
        for entry in reversed(self.entries.values()):
            for runs in reversed(tag_runs(len(entry.keys))):
                tag = tag_of(entry.digest, entry.keys[runs - 1])
                if tag not in out:
                    out.append(tag)
                if len(out) >= MAX_TAGS:
                    return out
        return out


# ---- a session's side: the service's open / save / Info call these -----------------------------------------------
def start_from_prefix(prefixes: PrefixCache, sessions, session, keys: tuple[bytes, ...]) -> None:
    """Begin the session with the longest cached prefix among `keys` of its scope, leaving room for one token at
    least. Its cache is reserved now (it holds memory from the open on); no room: it starts empty. `sessions`: the
    server's SessionTable."""
    found = prefixes.lookup(session.prefix_digest, session.state.blocks, keys)
    if found is None:
        return
    entry, runs = found
    runs = min(runs, (session.max_length - 1) // RUN_TOKENS)
    if runs < 1:
        return
    try:
        sessions.reserve(session)
    except CapacityExceeded:
        return
    # the reservation may have evicted the entry; then it is gone: start empty (and keep the reservation)
    if not any(e is entry for e in prefixes.entries.values()):
        return
    session.state.cache, session.state.mask = prefixes.restore(entry, runs, session.max_length)


def save_prefix(prefixes: PrefixCache | None, sessions, session, save) -> None:
    """Keep the first len(save.keys) runs the session holds as an entry of its scope (InvalidRequest: refused,
    nothing changes; no room: not kept). `save`: the wire's PrefixSave."""
    keys = check_keys(save.keys, "save")
    state = session.state
    if prefixes is None:
        raise InvalidRequest("this server keeps no prefix cache (--prefix-cache-mb 0)")
    if session.prefix_digest is None:
        raise InvalidRequest("save: the session's open named no prefix_scope")
    n_tokens = len(keys) * RUN_TOKENS
    if state.rows != 1 or n_tokens > state.position:
        raise InvalidRequest(f"save: {len(keys)} runs of {RUN_TOKENS} tokens, but the session holds "
                             f"{state.rows} rows x {state.position} tokens (a prefix is one row)")
    if not bool(state.mask[:, :n_tokens].all()):
        raise InvalidRequest("save: the prefix holds padding")
    prefixes.save(session.prefix_digest, state.blocks, keys, state.cache, sessions.free_bytes)


def info(prefixes: PrefixCache | None, counters: bool = True) -> pb.PrefixCacheInfo | None:
    """What the server's Info says of its prefix cache (None: it keeps none); `counters`: with the hits and hit
    tokens (per request: only for callers trusted with them, ServerConfig.publish_counters)."""
    if prefixes is None:
        return None
    hits, hit_tokens = (prefixes.stats.hits, prefixes.stats.hit_tokens) if counters else (0, 0)
    return pb.PrefixCacheInfo(limit_bytes=prefixes.limit_bytes, bytes=prefixes.bytes, entries=len(prefixes.entries),
                              hits=hits, hit_tokens=hit_tokens,
                              evictions=prefixes.stats.evictions, tags=prefixes.tags())
