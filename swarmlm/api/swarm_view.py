"""The swarm as the gateway sees it: DHT records, each server's live info (Info RPC), coverage per block.

Shared by `GET /v1/swarm`, the monitor page and `swarmlm status`. Reading the DHT and asking every server
costs a round trip each, so one reading is reused for `min_interval_s` however many monitors poll.
"""
from __future__ import annotations

import asyncio
import threading
import time

from swarmlm.client.channels import info
from swarmlm.swarm.records import ServerRecord

UNREACHABLE = "unreachable"  # announced in the DHT but did not answer the Info RPC
# announced, but this client will not use it (`refused`: why): another wire protocol, other weights, a failed connect
# check (client/remote.py); not asked for its Info
REFUSED = "refused"


class SwarmWatcher:
    def __init__(self, remote, info_timeout_s: float = 2.0, min_interval_s: float = 1.0) -> None:
        self.remote = remote  # the client's RemoteSequence
        self.info_timeout_s = info_timeout_s
        self.min_interval_s = min_interval_s
        self.last_seen: dict[str, float] = {}  # server id -> wall clock of its last Info answer
        self.lock = threading.Lock()
        self._cached: tuple[float, dict] | None = None

    def read(self) -> dict:
        """Blocking (DHT + RPCs): call from a worker thread."""
        with self.lock:
            if self._cached and time.monotonic() - self._cached[0] < self.min_interval_s:
                return self._cached[1]
            self.remote.refresh()
            records = dict(self.remote.view.records)
            replies = self.remote.loop.run(self._ask(list(records.values())))
            view = self._build(records, replies, dict(self.remote.refused))
            self._cached = (time.monotonic(), view)
            return view

    async def _ask(self, records: list[ServerRecord]) -> list:
        return await asyncio.gather(
            *(info(self.remote.channels, r.address, self.info_timeout_s) for r in records), return_exceptions=True
        )

    def _build(self, records: dict[str, ServerRecord], replies: list,
               refused: dict[str, tuple[ServerRecord, str]]) -> dict:
        now = time.time()
        servers = [self._server(r, reply, now) for r, reply in zip(records.values(), replies)]
        servers += [{**self._server(r, None, now), "state": REFUSED, "refused": why}
                    for sid, (r, why) in refused.items() if sid not in records]
        servers.sort(key=lambda s: (s["blocks"][0], s["blocks"][1], s["id"]))
        n = self.remote.num_blocks
        coverage = [[s["id"] for s in servers if s["state"] == "online" and s["blocks"][0] <= b < s["blocks"][1]]
                    for b in range(n)]
        missing = [b for b, ids in enumerate(coverage) if not ids]
        return {
            "num_blocks": n,
            "servers": servers,
            "coverage": [len(ids) for ids in coverage],  # live servers per block
            "missing_blocks": missing,
            "complete": not missing,
            "read_at": now,
        }

    def _server(self, r: ServerRecord, reply, now: float) -> dict:
        """One server's row: its record, with what its Info answered (`reply`: (InfoReply, rtt) or an error)."""
        live = None if reply is None or isinstance(reply, BaseException) else reply[0]
        if live is not None:
            self.last_seen[r.server_id] = now
        seen = self.last_seen.get(r.server_id)
        return {
            "id": r.server_id,
            "address": r.address,
            "relayed": r.relayed,  # behind NAT, reached through `relay` (docs/PROTOCOL.md)
            "relay": r.relay or None,
            "blocks": [r.start, r.end],  # half-open [start, end)
            "state": r.state if live is not None else UNREACHABLE,
            "decode_s_per_block": r.decode_s,  # announced speed
            "tokens_per_s": 1.0 / (r.decode_s * (r.end - r.start)) if r.decode_s > 0 else None,
            "cache_bytes_free": int(live.cache_bytes_free) if live else r.cache_bytes_free,
            "cache_bytes_total": int(live.cache_bytes_total) if live else r.cache_bytes_total,
            "active_sessions": int(live.active_sessions) if live else r.active_sessions,
            "queue_length": int(live.queue_length) if live else r.queue_length,
            "rtt_s": (reply[1] if live is not None else self.remote.view.rtt_s.get(r.server_id)),
            "last_seen_s_ago": (now - seen) if seen is not None else None,
            "version": r.version,
            "protocol": r.protocol,  # its wire protocol (wire/protocol.py; 0: announced none)
            # do its steps compute other values than the checkpoint's: its weights' quantization, and its blocks' and
            # caches' dtypes (kv_dtype float16 beside dtype float32: K/V rounded; "": a server before the fields)
            "quant": r.quant,
            "dtype": r.dtype,
            "kv_dtype": r.kv_dtype,
            "refused": None,
        }
