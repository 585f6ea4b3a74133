"""One frozen configuration per component; every field carries its unit and is checked on creation."""
from __future__ import annotations

from dataclasses import dataclass, field

from swarmlm.types import BlockRange


@dataclass(frozen=True)
class ServerConfig:
    model_dir: str
    blocks: BlockRange | None  # None: choose a range from what the swarm already covers
    initial_peers: tuple[str, ...] = ()  # DHT multiaddrs; empty = no swarm (direct address only)
    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port
    announce_host: str | None = None  # address others should dial (behind a relay or NAT); default = host
    threads: int = 1  # torch threads for compute; set explicitly, never left to torch's default
    dtype: str = "float32"
    num_blocks: int | None = None  # with blocks=None: how many blocks to take (None = from the memory budget)
    placement: str = "petals"  # how to choose a range when blocks=None: "petals" | "cg-bprr"
    memory_bytes: int | None = None  # budget for weights + caches when choosing num_blocks (None = 40% of RAM)
    cache_bytes: int = 256 << 20  # attention-cache budget across all sessions
    max_sessions: int = 64  # open sessions at once
    max_length_tokens: int = 2048  # longest session (prompt + generated) accepted
    max_batch: int = 64  # sequences in one session
    max_message_bytes: int = 64 << 20  # largest gRPC message accepted or sent
    session_idle_timeout_s: float = 120.0  # a session with no step for this long is closed
    announce_period_s: float = 2.0  # how often the DHT record is refreshed
    record_ttl_s: float = 8.0  # DHT records expire this long after their last refresh
    dht_prefix: str | None = None  # DHT key namespace (default: from the model directory's name)
    server_id: str | None = None  # default: the DHT peer id
    profile_cache_dir: str | None = None  # where start-up profiles are cached (None = ~/.cache/swarmlm)

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        for name in ("cache_bytes", "max_sessions", "max_length_tokens", "max_batch", "max_message_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.record_ttl_s <= self.announce_period_s:
            raise ValueError(
                f"record_ttl_s ({self.record_ttl_s}) must exceed announce_period_s ({self.announce_period_s})"
            )
        if self.blocks is None and self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.placement not in ("petals", "cg-bprr"):
            raise ValueError(f"placement must be 'petals' or 'cg-bprr', got {self.placement!r}")


@dataclass(frozen=True)
class ClientConfig:
    initial_peers: tuple[str, ...] = ()
    dht_prefix: str | None = None  # default: from the model directory's name
    servers: tuple[str, ...] = ()  # direct server addresses (host:port), bypassing the DHT
    dtype: str = "float32"  # dtype of hidden states on the wire and of the client's modules
    threads: int = 1  # torch threads for the client's embeddings and LM head
    wait_for_blocks_s: float = 30.0  # how long to wait for missing blocks before failing
    step_timeout_s: float = 60.0  # one step through one server
    connect_timeout_s: float = 5.0
    max_retries: int = 3  # failovers within one step before giving up
    ban_base_s: float = 2.0  # a failed server is avoided for this long, doubling on each repeat failure
    ban_max_s: float = 60.0
    routing: str = "waiting-aware"  # "shortest" | "waiting-aware"
    max_message_bytes: int = 64 << 20
    extra: dict = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        if self.routing not in ("shortest", "waiting-aware"):
            raise ValueError(f"routing must be 'shortest' or 'waiting-aware', got {self.routing!r}")
        if self.threads < 1 or self.max_retries < 0:
            raise ValueError("threads must be >= 1 and max_retries >= 0")
