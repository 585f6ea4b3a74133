"""What a server announces in the DHT, per block it serves. Small (well under hivemind's 16 KB limit) and
validated on read: a malformed record from a peer is dropped, never trusted."""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from swarmlm.config import ANNOUNCED_DTYPES, ANNOUNCED_QUANTS, MAX_RECORD_TTL_S  # noqa: F401 (dht.py, tests read it)
from swarmlm.wire.protocol import MAX_PROTOCOL, protocol_refusal

# online: serving; offline: withdrawn. Before it serves, a server announces its range as joining (still choosing its
# blocks), then loading (chosen; at once with --blocks): never routed to, but servers placing themselves count it, so
# servers that start together spread out (server/placement.py)
ONLINE, OFFLINE, JOINING, LOADING = "online", "offline", "joining", "loading"
# A record lives at most this long after its writer's last store: swarmlm DHT nodes refuse, and readers drop, a record
# whose expiration lies further ahead (the writer chooses its expiration; a rogue would choose "in a year"). Servers'
# record_ttl_s must fit under it (MAX_RECORD_TTL_S, in config.py). MAX_CLOCK_SKEW_S is the slack for peers whose
# clocks run ahead.
MAX_CLOCK_SKEW_S = 5.0
_ADAPTER = re.compile(r"^[A-Za-z0-9._\-]{1,64}(?:@[0-9a-f]{16})?$")  # server/adapters.py NAME [@ fingerprint]
_ADDRESS = re.compile(r"^[A-Za-z0-9.\-\[\]:]{1,200}:\d{1,5}$")
TAG_CHARS = 16  # one prefix-cache tag (server/prefix_cache.py tag_of)
_TAGS = re.compile(r"^(?:[0-9a-f]{16}){0,64}$")


@dataclass(frozen=True)
class ServerRecord:
    server_id: str
    address: str  # host:port of the gRPC service; "p2p/<peer id>" behind NAT (reached through `relay`)
    start: int  # served blocks [start, end)
    end: int
    state: str = ONLINE
    relay: str = ""  # behind NAT: the relay it listens through (/ip4/A/tcp/P/p2p/ID); "" there = none takes it
    decode_s: float = 0.0  # measured seconds per block per decode token
    prefill_a_s: float = 0.0  # per block: prefill seconds = a * tokens + b
    prefill_b_s: float = 0.0
    cache_bytes_free: int = 0
    cache_bytes_total: int = 0
    session_bytes_per_block_token: int = 0  # cache bytes one sequence needs per block per token
    active_sessions: int = 0
    queue_length: int = 0
    max_length: int = 0
    version: str = ""
    protocol: int = 0  # its wire protocol (wire/protocol.py); 0 = announced none: a release before the field
    fingerprint: str = ""  # the weights of [start, end) (swarmlm/model/fingerprint.py); clients compare their own
    quant: str = "none"  # do the weights compute other values than the checkpoint's: "none" | "int8" | "int4"
    weight_bytes: int = 0  # bytes the served blocks' weights take in memory (0 = not announced)
    # per block, one decode forward of 4 / 16 rows: how its steps slow down with its sessions (0 = not announced)
    decode_4rows_s: float = 0.0
    decode_16rows_s: float = 0.0
    joined_at: float = 0.0  # joining/loading: wall-clock s of its first joining record; orders joiners (who yields)
    # pre-loaded LoRA adapters, comma-separated `name@fingerprint` (server/adapters.py); "" = none
    adapters: str = ""
    # its blocks' compute dtype and its attention caches' (ANNOUNCED_DTYPES; server/kv_dtype.py). "" = not announced:
    # a server from before these fields, whose caches held its blocks' dtype (--kv-dtype came with the fields), so
    # an absent kv_dtype is never a narrowed cache
    dtype: str = ""
    kv_dtype: str = ""

    @property
    def narrowed_cache(self) -> bool:
        """Caches of another dtype than its blocks' (server/kv_dtype.py allows one: float16 beside float32 blocks):
        K/V rounded, so its steps differ slightly from what its weights alone compute (ClientConfig
        require_full_precision leaves it out)."""
        return bool(self.kv_dtype) and self.kv_dtype != self.dtype

    @property
    def adapter_names(self) -> tuple[str, ...]:
        return tuple(self.adapters.split(",")) if self.adapters else ()

    @property
    def adapter_versions(self) -> dict[str, str]:
        """name -> its announced fingerprint ("" if the server announced none)."""
        return dict((n.partition("@")[0], n.partition("@")[2]) for n in self.adapter_names)

    # the prefix cache's most recently used entries, as concatenated 16-hex tags (at most 64): a client knowing the
    # scope sees which of its prompts' prefixes this server holds (server/prefix_cache.py, client/prefix.py)
    prefix_tags: str = ""

    @property
    def prefix_tag_set(self) -> frozenset[str]:
        t = self.prefix_tags
        return frozenset(t[i:i + TAG_CHARS] for i in range(0, len(t), TAG_CHARS))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def relayed(self) -> bool:
        """Behind NAT: reached only through its relay (swarm/reach.py), never at an IP address."""
        return bool(_P2P_ADDRESS.match(self.address))

    @classmethod
    def from_dict(cls, value: Any) -> "ServerRecord":
        """Parse a peer's record, raising ValueError on anything malformed."""
        if not isinstance(value, dict):
            raise ValueError("record is not a mapping")
        known = cls.__dataclass_fields__
        kwargs: dict[str, Any] = {}
        for name, field in known.items():
            if name not in value:
                if name in ("server_id", "address", "start", "end"):
                    raise ValueError(f"record lacks {name}")
                continue
            v = value[name]
            want = {"str": str, "int": int, "float": (int, float)}[field.type]
            if isinstance(v, bool) or not isinstance(v, want):
                raise ValueError(f"record field {name} has type {type(v).__name__}")
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"record field {name} is not finite")
            if isinstance(v, (int, float)) and v < 0:
                raise ValueError(f"record field {name} is negative")
            kwargs[name] = float(v) if want == (int, float) else v
        record = cls(**kwargs)
        if not 0 <= record.start < record.end:
            raise ValueError(f"record range [{record.start}, {record.end}) is empty")
        if not (_ADDRESS.match(record.address) or record.relayed):
            raise ValueError(f"record address {record.address!r} is not host:port or p2p/<peer id>")
        if record.relay:
            if not record.relayed:
                raise ValueError("record names a relay but has a direct address")
            from swarmlm.swarm.p2p_link import parse_relay_addr

            parse_relay_addr(record.relay)  # (ValueError)
        if record.state not in (ONLINE, OFFLINE, JOINING, LOADING):
            raise ValueError(f"record state {record.state!r}")
        if record.quant not in ANNOUNCED_QUANTS:
            raise ValueError(f"record quant {record.quant!r}")
        for name in ("dtype", "kv_dtype"):
            if getattr(record, name) not in ("", *ANNOUNCED_DTYPES):
                raise ValueError(f"record {name} {getattr(record, name)[:80]!r} is not one of "
                                 f"{', '.join(ANNOUNCED_DTYPES)}")
        if record.kv_dtype and not record.dtype:  # (a cache's dtype means nothing without its blocks')
            raise ValueError(f"record kv_dtype {record.kv_dtype!r} without its blocks' dtype")
        if len(record.adapters) > 1400 or not all(_ADAPTER.match(n) for n in record.adapter_names):
            raise ValueError(f"record adapters {record.adapters[:80]!r}")
        if record.protocol > MAX_PROTOCOL:
            raise ValueError(f"record protocol {record.protocol} is over {MAX_PROTOCOL}")
        if not _TAGS.match(record.prefix_tags):
            raise ValueError("record prefix_tags must be at most 64 tags of 16 lowercase hex characters")
        return record


_P2P_ADDRESS = re.compile(r"^p2p/[1-9A-HJ-NP-Za-km-z]{40,60}$")  # a server behind NAT: its libp2p peer id


def of_our_protocol(records: dict[str, ServerRecord]) -> dict[str, ServerRecord]:
    """The servers that speak this release's wire protocol (wire/protocol.py protocol_refusal): clients route to no
    other, so no other covers a block, for a server placing itself, for a client waiting on loaders, as a push
    target."""
    return {sid: r for sid, r in records.items() if protocol_refusal(r.protocol) is None}


def record_from_info(info, address: str, state: str = ONLINE, relay: str = "") -> ServerRecord:
    """The one conversion between a server's `Info` reply (pb.InfoReply) and what it announces: the server
    builds its DHT record with it, a client with a fixed server list reads its servers with it. Validated as
    a DHT record is (a peer's reply is not trusted)."""
    return ServerRecord.from_dict({
        "server_id": info.server_id, "address": address, "start": info.start_block, "end": info.end_block,
        "state": state, "relay": relay, "decode_s": info.decode_s_per_block, "prefill_a_s": info.prefill_a_s,
        "prefill_b_s": info.prefill_b_s, "cache_bytes_free": info.cache_bytes_free,
        "cache_bytes_total": info.cache_bytes_total,
        "session_bytes_per_block_token": info.session_bytes_per_block_token,
        "active_sessions": info.active_sessions, "queue_length": info.queue_length, "max_length": info.max_length,
        "version": info.version, "protocol": info.protocol,
        "fingerprint": info.fingerprint,
        "quant": info.quant or "none", "weight_bytes": info.weight_bytes,  # (older servers send no quant)
        "decode_4rows_s": info.decode_4rows_s_per_block, "decode_16rows_s": info.decode_16rows_s_per_block,
        "adapters": ",".join(info.adapters),
        "dtype": info.dtype, "kv_dtype": info.kv_dtype,  # ("" kv_dtype: an older server, caches of its dtype)
        "prefix_tags": "".join(info.prefix_cache.tags),
    })


def block_key(dht_prefix: str, block: int) -> str:
    return f"{dht_prefix}.block{block}"
