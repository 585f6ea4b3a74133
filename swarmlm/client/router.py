"""Which servers a session goes through. The choice itself is the planner's `WaitingAwareRouter` (BPRR's WS-RR,
the code the simulator runs); this module only feeds it what this client sees of the swarm:

* servers and their compute profiles, from the DHT records (or `Info` replies of a fixed server list), with the
  contention each announces (a decode forward of 4 and 16 rows: the router's and the simulator's f(b)); a server
  that announces none is taken to share its compute without batching gains (f(b) = b, the cautious bound);
* links: the RTTs this client measured (remote.py probes them);
* slots: a server's cache, in sessions of this request's size (blocks x batch x tokens x the server's announced
  per-token session bytes): total from `cache_bytes_total`, free from `cache_bytes_free`;
* load: the sessions it announced running (or queued), or at least this client's own, admitted when opened;
* bans: servers that failed lately are left out for a while (bounded exponential backoff);
* prefixes: the prompt tokens a server announces it holds for this client (its record's prefix-cache tags), priced
  off its hop by the performance model (perf/prefix.py).

`routing="shortest"` is the baseline: the same router on hop costs alone (no waits, no load).
"""
from __future__ import annotations

import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from swarmlm.config import ClientConfig
from swarmlm.errors import MissingBlocks
from swarmlm.perf.model import ComputeProfile, Network, PerfModel
from swarmlm.planner.routing import WaitingAwareRouter
from swarmlm.swarm.records import ServerRecord
from swarmlm.types import BlockRange, Route, Span

CLIENT = "client"  # this client's node name in the performance model
DEFAULT_RTT_S = 0.005  # a server's RTT until a probe has measured it
UNKNOWN_SLOTS = 1 << 30  # a server that does not announce its cache size: never waited for
MAX_KEPT_PUSH_ANSWERS = 1024  # push_pays answers kept between syncs (chains of servers; a bound, not a tuning)


@dataclass
class Ban:
    until_s: float
    failures: int
    tampered: bool = False  # its session's messages failed their MAC check: a connect check does not lift it


@dataclass
class SwarmView:
    """Live servers (from the DHT or a fixed list), their RTTs, and servers this client avoids for a while."""

    config: ClientConfig
    records: dict[str, ServerRecord] = field(default_factory=dict)
    rtt_s: dict[str, float] = field(default_factory=dict)  # server id -> measured round trip
    bans: dict[str, Ban] = field(default_factory=dict)
    read_s: float = -math.inf  # time.monotonic() of the last read of the records
    # the active adapter's fingerprint this client routes to: asked for (`name@fingerprint`) or chosen at its first
    # read and kept, so no generation mixes two versions of one adapter name (server/adapters.py)
    adapter_version: str = ""

    def update(self, records: dict[str, ServerRecord]) -> None:
        if self.config.require_full_precision:  # quantized servers (model/quant.py) and narrowed caches (float16 K/V
            # beside float32 blocks, server/kv_dtype.py) are left out of every route: both compute other values
            records = {sid: r for sid, r in records.items() if r.quant == "none" and not r.narrowed_cache}
        if self.config.active_adapter:  # only servers that pre-loaded the adapter (server --adapters)
            records = self._with_adapter(records)
        self.records = records
        self.read_s = time.monotonic()

    def _with_adapter(self, records: dict[str, ServerRecord]) -> dict[str, ServerRecord]:
        """Servers holding the active adapter in one version: the one asked for, else the one the most servers
        announced at this client's first read that found any (kept from then on)."""
        name, _, asked = self.config.active_adapter.partition("@")
        offered = {sid: r.adapter_versions.get(name) for sid, r in records.items()}
        if not self.adapter_version:
            counts = Counter(v for v in offered.values() if v)
            self.adapter_version = asked or (max(counts, key=lambda v: (counts[v], v)) if counts else "")
        return {sid: r for sid, r in records.items() if offered[sid] and offered[sid] == self.adapter_version}

    @property
    def adapter(self) -> str:
        """What a session opens with: `name@fingerprint` (empty without an active adapter)."""
        if not self.config.active_adapter:
            return ""
        return f"{self.config.active_adapter.partition('@')[0]}@{self.adapter_version}"

    def ban(self, server_id: str, tampered: bool = False) -> float:
        """Avoid a failed server, longer each time it fails again (bounded exponential backoff); one whose messages
        were changed on the way (`tampered`), for the longest ban at once."""
        prev = self.bans.get(server_id)
        failures = prev.failures + 1 if prev else 1
        duration = self.config.ban_max_s if tampered else min(self.config.ban_base_s * 2 ** (failures - 1),
                                                               self.config.ban_max_s)
        self.bans[server_id] = Ban(time.monotonic() + duration, failures, tampered)
        return duration

    def banned(self) -> frozenset[str]:
        now = time.monotonic()
        return frozenset(sid for sid, b in self.bans.items() if b.until_s > now)

    def usable(self) -> dict[str, ServerRecord]:
        banned = self.banned()
        return {sid: r for sid, r in self.records.items() if sid not in banned}


def slots(record: ServerRecord, session_bytes: int) -> tuple[int, int]:
    """(total, free) slots of a server in block-sessions of `session_bytes` per block."""
    if not (record.cache_bytes_total and session_bytes):
        return UNKNOWN_SLOTS, UNKNOWN_SLOTS
    return record.cache_bytes_total // session_bytes, record.cache_bytes_free // session_bytes


def profile_of(record: ServerRecord) -> ComputeProfile:
    """The announced compute profile; without an announced contention, the no-batching bound f(b) = b."""
    if record.decode_4rows_s > 0 and record.decode_16rows_s > 0:
        return ComputeProfile(record.prefill_a_s, record.prefill_b_s, record.decode_s, record.decode_4rows_s,
                              record.decode_16rows_s)
    return ComputeProfile.no_batching(record.prefill_a_s, record.prefill_b_s, record.decode_s)


class LiveRouter:
    """The planner's WaitingAwareRouter kept in step with the client's SwarmView, plus this client's sessions."""

    def __init__(self, view: SwarmView, num_blocks: int) -> None:
        self.view = view
        self.network = Network(default_rtt_s=DEFAULT_RTT_S)
        self.perf = PerfModel({}, self.network)
        self.router = WaitingAwareRouter(self.perf, num_blocks)
        self._synced: dict[str, tuple] = {}  # server id -> what the router was last told about it
        self._admitted = 0
        self._push_pays: dict[tuple[str, ...], bool] = {}  # chain of server ids -> push_pays, until the next _sync
        self.syncs = 0  # _sync calls so far: what a session decided from the links holds while this stays
        # sessions open on the client's I/O thread, routes are chosen on the callers' threads: one at a time
        self._lock = threading.Lock()

    def _sync(self, bytes_per_block_token: int) -> None:
        """Tell the router what changed: servers gone or new, profiles, RTTs, slots and load."""
        records = self.view.records
        self._push_pays.clear()  # (the links may change below)
        self.syncs += 1
        for sid in [s for s in self._synced if s not in records]:
            self.router.remove_server(sid)
            del self._synced[sid]
        changed = False
        for sid, r in records.items():
            profile = profile_of(r)
            rtt = self.view.rtt_s.get(sid)
            total, free = slots(r, r.session_bytes_per_block_token * bytes_per_block_token)
            state = (profile, rtt, r.start, r.end, total)
            if self._synced.get(sid) != state:
                self.perf.set_profile(sid, profile)
                if rtt is not None:
                    self.network.set_link(CLIENT, sid, rtt)
                self.router.set_server(sid, BlockRange(r.start, r.end), total)
                self._synced[sid] = state
                changed = True
            self.router.set_load(sid, free, sessions=max(r.active_sessions, r.queue_length))
        if changed:
            self.router.refresh()

    def route(self, start: int, end: int, l_in: int, l_out: int, batch: int = 1, max_length: int = 0,
              prefix_held: Callable[[ServerRecord], int] | None = None) -> Route:
        """The cheapest chain over blocks [start, end) with the servers this client may use; `prefix_held`: the
        prompt tokens a server announces it holds for this client (client/prefix.py), priced off its hop."""
        waiting_aware = self.view.config.routing == "waiting-aware"
        window, exclude = BlockRange(start, end), self.view.banned()
        with self._lock:
            # a slot is one session of this request's size on one block: batch sequences x the tokens it may hold
            self._sync(batch * max(max_length, l_in + l_out))
            now = time.monotonic()
            held = {sid: prefix_held(r) for sid, r in self.view.records.items()} if prefix_held else None
            try:
                hops = self.router.route(CLIENT, now, l_in, l_out, waiting_aware, window, exclude, held)
            except MissingBlocks:
                if not waiting_aware:
                    raise
                # every chain waits for cache that announced load holds, with no known end: take the shortest and
                # let the servers' own admission decide (a refusal is routed around like a failure)
                hops = self.router.route(CLIENT, now, l_in, l_out, False, window, exclude, held)
            records = dict(self.view.records)
        return Route(tuple(Span(s.server_id, s.start, s.end, records[s.server_id].address) for s in hops.spans))

    def push_pays(self, spans: list[Span]) -> bool:
        """Whether server-to-server push saves time on `spans`, from the measured RTTs (PerfModel.push_pays). Its
        answer depends on the servers' links only, which change in `_sync` alone: kept per chain of servers until
        then (a session asks before every step, ~50 calls of the performance model each time)."""
        key = tuple([s.server_id for s in spans])  # (a list, not a generator: one frame a step, not one per span)
        with self._lock:
            pays = self._push_pays.get(key)
            if pays is None:
                if len(self._push_pays) >= MAX_KEPT_PUSH_ANSWERS:
                    self._push_pays.clear()
                pays = self._push_pays[key] = self.perf.push_pays(CLIENT, spans)
            return pays

    def pass_s(self, spans: list[Span], n_tokens: int, push: bool) -> float:
        """Predicted seconds of one step of `tokens` tokens along `spans` (PerfModel.pass_s)."""
        with self._lock:
            return self.perf.pass_s(CLIENT, spans, n_tokens, push)

    def admit(self, spans: list[Span], l_in: int, l_out: int) -> str:
        """Count a session this client opened on `spans` until `release` (the router's load and slots)."""
        with self._lock:
            self._admitted += 1
            key = f"own-{self._admitted}"
            known = [s for s in spans if s.server_id in self._synced]
            until = time.monotonic() + self.perf.request_time_s(CLIENT, known, l_in, l_out)
            self.router.admit(key, known, until)
            return key

    def release(self, key: str) -> None:
        with self._lock:
            self.router.release(key)
