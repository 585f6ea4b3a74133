"""What a server announces in the DHT, per block it serves. Small (well under hivemind's 16 KB limit) and
validated on read: a malformed record from a peer is dropped, never trusted."""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

ONLINE, OFFLINE = "online", "offline"
_ADDRESS = re.compile(r"^[A-Za-z0-9.\-\[\]:]{1,200}:\d{1,5}$")


@dataclass(frozen=True)
class ServerRecord:
    server_id: str
    address: str  # host:port of the gRPC service
    start: int  # served blocks [start, end)
    end: int
    state: str = ONLINE
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

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
        if not _ADDRESS.match(record.address):
            raise ValueError(f"record address {record.address!r} is not host:port")
        if record.state not in (ONLINE, OFFLINE):
            raise ValueError(f"record state {record.state!r}")
        return record


def block_key(prefix: str, block: int) -> str:
    return f"{prefix}.block{block}"
