"""One frozen configuration per component; every field carries its unit and is checked on creation."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from swarmlm.types import BlockRange

# the form of a server's (or client's) weights (swarmlm/model/quant.py): "auto" = a GGUF's own quantized blocks, a
# float checkpoint as it is; "none" = dequantized; "int8" / "int4" = a float checkpoint in blocks of 32 on load
QUANT_NAMES = ("auto", "none", "int8", "int4")
# what a server announces: whether its weights compute other values than the checkpoint's (a GGUF kept in its own
# blocks computes the file's values: "none")
ANNOUNCED_QUANTS = ("none", "int8", "int4")
# what a server's attention caches hold (swarmlm/server/kv_dtype.py): "auto" = the blocks' compute dtype, "float32",
# or "float16" (half the bytes per cached token; K/V rounded to float16 when written, attention computed in float32)
KV_DTYPE_NAMES = ("auto", "float32", "float16")
# what a server announces of its blocks' compute dtype and of its caches' dtype (swarm/records.py dtype, kv_dtype)
ANNOUNCED_DTYPES = ("float32", "bfloat16", "float16")
# A DHT record lives at most this long after its writer's last store (swarm/records.py): servers' record_ttl_s must
# fit under it. Defined here, with the settings it bounds: config sits below swarm in the layering.
MAX_RECORD_TTL_S = 60.0
# the route's earlier servers may be slower than this one, or the machine busier than when it was measured: a span's
# first step may come this many times their estimated prefill after its open (ServerConfig.open_idle_limit_s)
UPSTREAM_PREFILL_SLACK = 2.0

# "auto" = the checkpoint's own dtype, except on a CPU: float16 runs as float32, and bfloat16 too unless the CPU
# has bf16 matmul units (AMX), where bf16 is faster; see swarmlm/model/checkpoint.py auto_dtype
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
# other spellings transformers' from_pretrained takes for these: torch's own attribute names, and torch dtypes
# (torch.float32, whose str is "torch.float32")
DTYPE_ALIASES = {"float": "float32", "half": "float16"}


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask: a container's or taskset's limit, not the host's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def dtype_name(value: object) -> str:
    """A dtype as transformers takes it ("auto", "float32", "torch.float32", "half", torch.float32...) -> its name
    in DTYPE_NAMES; anything else is refused."""
    name = (value if isinstance(value, str) else str(value)).removeprefix("torch.")
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)} (or a torch dtype of these), got {value!r}")
    return name
WIRE_DTYPE_NAMES = ("auto", "auto-lossy", "float32", "float16", "bfloat16", "int8")  # as swarmlm/wire/compress.py
PushMode = Literal["auto", "on", "off"]  # ClientConfig.push
PUSH_MODES: tuple[PushMode, ...] = ("auto", "on", "off")


@dataclass(frozen=True)
class StragglerWait:
    """How long a batch about to run waits for members expected soon (the server's compute rounds,
    server/scheduler.py; the client's LM heads, client/head_batcher.py): at most `fraction` x the last batch's
    compute time and at most `max_s`, and only while someone expected is missing. A lone member never waits:
    nobody else is expected."""

    fraction: float  # of the last batch's compute time (0 = never wait)
    max_s: float  # seconds, whatever the last batch took

    def __post_init__(self) -> None:
        if self.fraction < 0 or self.max_s < 0:
            raise ValueError(f"a straggler wait's fraction ({self.fraction}) and max_s ({self.max_s}) must be >= 0")

    def left_s(self, missing: int, last_batch_s: float, waited_s: float) -> float:
        """Seconds more to wait, having waited `waited_s` already, with `missing` expected members not arrived:
        0 = run the batch now."""
        if missing <= 0:
            return 0.0
        return max(0.0, min(self.max_s, self.fraction * last_batch_s) - waited_s)


@dataclass(frozen=True)
class SchedulerConfig:
    """The server's compute rounds (server/scheduler.py)."""

    # continuous batching: one compute round takes queued steps of all sessions up to this many tokens (rows x new
    # tokens; a decode step of a batch-1 session is 1). Larger: more decode steps share a forward and prefill
    # chunks join rounds sooner; smaller: a round (so the wait for the next token) is shorter.
    max_batch_tokens: int = 512
    max_prefill_skips: int = 2  # rounds the oldest prefill that does not fit the budget may be passed over
    # before a round, wait for the last decode forwards' sessions to send their next step (of the longer of the last
    # two decode forwards), so sessions in lockstep share one forward
    batch_wait: StragglerWait = StragglerWait(fraction=0.05, max_s=0.01)
    # a lone session's decode step whose last forward took at most this long runs on the I/O loop's thread, without
    # the two hand-offs to the compute thread and back; it blocks the loop that long (0 = never). Side by side at
    # load 7-9 (docs/RESULTS-hop.md "Round 6"): in real decoding (the client's LM head between steps) it helps framed
    # steps (1.99 vs 3.95 ms per SmolLM2 hop outside compute); with steps back to back it hurts them (2.06 vs 0.94).
    # A quarter second covers a float32 bloomz-560m span (60-100 ms a forward here), whose two hand-offs were the
    # largest item of its hop (RESULTS-hop.md round 18), and stays far under every time a peer holds this server to
    # (the client's hang floor 5 s, the DHT announce period 2 s): what waits meanwhile (Info, opens, another session's
    # first step) would wait for this forward's CPU anyway
    inline_decode_max_s: float = 0.25

    def __post_init__(self) -> None:
        if self.max_batch_tokens < 1 or self.max_prefill_skips < 0:
            raise ValueError(f"max_batch_tokens ({self.max_batch_tokens}) must be >= 1 and max_prefill_skips "
                             f"({self.max_prefill_skips}) >= 0")
        if self.inline_decode_max_s < 0:
            raise ValueError(f"inline_decode_max_s must be >= 0, got {self.inline_decode_max_s}")


# What a message costs beyond the network's round trip and the server's compute, on the default transport (framed
# steps, wire/frames.py): serialising, parsing, the wire stack's wake-ups and thread hand-offs on both ends. Measured:
# `benchmarks/hop_breakdown.py --transports` step minus server compute per hop, tiny-bloom on loopback, medians
# (docs/RESULTS-hop.md rounds 14-15, calm: framed 0.23-0.34 ms at 1-3 servers; gRPC's Inference streams 0.58-0.78
# ms; a hop after a long forward costs more: bloomz-560m framed 1.0-1.4 ms, its caches cold). Round 21's step lanes
# (calm): tiny-bloom 0.10-0.13 ms, a SmolLM2 server added ~0.14 ms, bloomz-560m 0.31-0.41 ms; 0.3 ms stays one
# constant for every shape inside that range (lowering it moves the MoLink chunk split: ChunkRule). A prefill
# chunk's fixed cost (ChunkRule), and the performance model's per-hop message cost (PerfModel.message_overhead_s:
# planner, router, simulator), on top of a link's RTT. (A live client's RTT comes from Info probes, whose own unary
# call already carries part of such a cost: it is counted twice there, alike for every route, so it changes no
# choice between routes of equal hop counts.)
MESSAGE_OVERHEAD_S = 0.3e-3


@dataclass(frozen=True)
class ChunkRule:
    """The automatic prefill chunk size's bounds and costs (client/chunking.py)."""

    min_tokens: int = 16  # below this, per-message costs dominate whatever the link
    max_tokens: int = 256  # above this, a chunk holds a slow link for long (256 tokens of a 4 KB state = 1 MB)
    overhead_fraction: float = 0.1  # on a compute-bound hop: a chunk's fixed cost at most this share of its compute
    message_overhead_s: float = MESSAGE_OVERHEAD_S  # per message: framing, parse/relay, wake-ups (measured)

    def __post_init__(self) -> None:
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"need 1 <= min_tokens ({self.min_tokens}) <= max_tokens ({self.max_tokens})")
        if not 0 < self.overhead_fraction <= 1:
            raise ValueError(f"overhead_fraction must be in (0, 1], got {self.overhead_fraction}")
        if self.message_overhead_s < 0:
            raise ValueError(f"message_overhead_s must be >= 0, got {self.message_overhead_s}")


@dataclass(frozen=True)
class ServerConfig:
    model_dir: str
    blocks: BlockRange | None  # None: choose a range from what the swarm already covers
    initial_peers: tuple[str, ...] = ()  # DHT multiaddrs; empty = no swarm (direct address only)
    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port
    announce_host: str | None = None  # address others should dial (behind a relay or NAT); default = host
    # how peers reach it (docs/PROTOCOL.md, "Servers behind NAT"): "auto" = a relay dials it back at start-up, and
    # if that fails it is served through a relay (not with announce_host: the operator said where it is reached);
    # "direct" = at its address; "relayed" = through a relay without the check
    reachability: Literal["auto", "direct", "relayed"] = "auto"
    # torch threads for compute, set explicitly (never torch's default): every core this process may use, since
    # a server is usually its machine's one job (give fewer when it shares the machine)
    threads: int = field(default_factory=usable_cores)
    dtype: str = "auto"  # weights and compute: "auto" or one of DTYPE_NAMES (a torch dtype is turned into its name)
    # weights of the linear layers (QUANT_NAMES): "auto" keeps a GGUF's quantized blocks (the file's bytes in memory,
    # the file's values computed), "int8" / "int4" quantize a float checkpoint weight-only in blocks of 32 (announced:
    # clients may refuse them), "none" dequantizes everything
    quant: str = "auto"
    kv_dtype: str = "auto"  # the sessions' attention caches (KV_DTYPE_NAMES; server/kv_dtype.py)
    # keep full-precision weights as views of the checkpoint file's mapping (pages shared by the host's servers of
    # the same file) instead of copying them into the process: ~1.5x slower decode here (model/checkpoint.py)
    mmap_weights: bool = False
    adapters: tuple[str, ...] = ()  # PEFT LoRA adapter directories served per session (server/adapters.py)
    num_blocks: int | None = None  # with blocks=None: how many blocks to take (None = from the memory budget)
    placement: str = "petals"  # how to choose a range when blocks=None: "petals" | "cg-bprr"
    # memory for weights as loaded + cache_bytes (server/placement.py check_fits: larger requests are refused before
    # loading); None = the memory available (the block count chosen with no num_blocks: within 40% of it)
    memory_bytes: int | None = None
    cache_bytes: int = 256 << 20  # attention-cache budget across all sessions
    # finished sessions' prefixes kept for later sessions (server/prefix_cache.py), within cache_bytes and giving
    # way to live sessions' reservations; 0 = off
    prefix_cache_bytes: int = 64 << 20
    # Info's per-request counters (prefix hits and hit tokens, tokens computed) to any caller; off, they are sent
    # only in a private swarm (every caller holds its key): a stranger timing them learned others' prompts (issue 39)
    publish_counters: bool = False
    max_sessions: int = 64  # open sessions at once
    max_length_tokens: int = 2048  # longest session (prompt + generated) accepted
    max_batch: int = 64  # sequences in one session
    scheduler: SchedulerConfig = SchedulerConfig()  # compute rounds: batching, straggler wait, inline decodes
    max_message_bytes: int = 64 << 20  # largest gRPC message (and frame, wire/frames.py) accepted or sent
    # also serve Inference streams and pushes as frames on plain TCP, on a second port of the same host (announced
    # in Info; relayed servers: gRPC only), for clients that opt in (ClientConfig.frames). False = gRPC only
    frames: bool = True
    # push to the next server on its framed port when it announces one (server/frame_push.py); False = gRPC's Push
    # (framed: 0.77 vs 1.09 ms per pushed hop, docs/RESULTS-hop.md round 7)
    push_frames: bool = True
    # a lone session's compact decode step (T = 1) of a span the one-call decoder runs is answered in one kernel call:
    # values checked, the span, the whole ANSWER frame (kernels/lane.c); False = Python around the decoder
    one_call_steps: bool = True
    # a lone keyed session's plain decode steps on a packed span are taken in one C call as their frame arrives
    # (server/lane.py: no Python between the socket and the kernel); False = every step the usual way
    step_lane: bool = True
    # a framed connection whose stream ended cleanly waits this long for the client's next stream (its next
    # session: clients keep such connections), then it is closed
    frame_idle_timeout_s: float = 60.0
    session_idle_timeout_s: float = 120.0  # a session with no step for this long is closed
    push_timeout_s: float = 10.0  # a push to the next server (server/push.py) not answered by then has failed
    # steps of one session waiting to run; a full inbox holds the client's stream and pushers back
    inbox_steps: int = 8
    push_room_wait_s: float = 30.0  # how long a push may wait for room in a session's inbox, then RESOURCE_EXHAUSTED
    max_steps_ahead: int = 8  # steps a session holds while waiting for an earlier step id (server/push.py StepOrder)
    max_push_channels: int = 64  # open channels to push targets (least recently used closed first)
    # after refusing a request at least this large, hand freed memory back to the OS (at most once a second)
    trim_refused_bytes: int = 16 << 20
    # Limits against greedy or hostile peers (docs/FAILURES.md, "Bounded resources"). A peer is a remote host.
    # a session whose first step has not come this long after its open is closed (opens cost no cache), plus the
    # time the route's earlier servers take first: a span from block s waits for blocks 0..s-1 to prefill
    # (open_idle_limit_s); a first step counts once admitted (its cache reserved), not once computed
    open_idle_timeout_s: float = 10.0
    resume_grace_s: float = 5.0  # a session whose stream broke is closed unless resumed (with its secret) this soon
    max_sessions_per_peer: int = 32  # open sessions one host may hold here
    max_peer_cache_fraction: float = 0.5  # share of cache_bytes the sessions of one host may reserve
    max_peer_bytes_in_flight: int = 256 << 20  # request bytes of one host received and not yet answered
    max_concurrent_rpcs: int = 256  # gRPC calls at once (streams included); more are refused RESOURCE_EXHAUSTED
    max_request_tokens: int = 32768  # rows x new tokens of one step or Forward (B=16 x 2048)
    max_attention_cost: int = 1 << 26  # rows x new tokens x context of one request (B x T^2: 16 x 2048^2)
    # training (server/training.py): estimated peak memory of one Backward (every block's input + one block's
    # activations); clients split larger batches into chunks of rows
    max_train_request_bytes: int = 256 << 20
    # the sum of those estimates over every training request admitted at once (server/train_service.py TrainBudget):
    # a request that does not fit waits up to train_admission_wait_s for others to finish, then RESOURCE_EXHAUSTED
    max_train_total_bytes: int = 1 << 30
    train_admission_wait_s: float = 30.0
    max_lora_rank: int = 64  # rank of a client's LoRA matrices sent with a request or a session's open
    max_lora_layers: int = 1024  # LoRA'd linear layers in one request (or open)
    announce_period_s: float = 2.0  # how often the DHT record is refreshed
    record_ttl_s: float = 8.0  # DHT records expire this long after their last refresh
    # a server placing itself (blocks=None) announces its choice as joining, then re-checks it after 0.5-1.5x this
    # against the servers that joined meanwhile, until it holds (server/placement.py; 0 = announce, no re-check)
    join_settle_s: float = 1.0
    dht_prefix: str | None = None  # DHT key namespace (default: from the model directory's name)
    # the server's key pair (swarm/identity.py): its id is derived from the public key. A PEM file, created (0600) if
    # absent, keeps the id across restarts; None = a fresh key (and id) per process
    identity_file: str | None = None
    swarm_key: bytes | None = field(default=None, repr=False)  # a private swarm's shared secret (swarm/private.py)
    profile_cache_dir: str | None = None  # where start-up profiles are cached (None = ~/.cache/swarmlm)
    drain_timeout_s: float = 30.0  # on SIGTERM: how long open sessions may go on before the server stops
    rebalance_period_s: float = 30.0  # with blocks=None: how often to check whether moving helps (0 = never)
    # a block that only joining / loading records cover for longer than this counts as uncovered again: a loader that
    # never serves (stuck, or hostile) keeps spares off it no longer (a llama-8b move took 30-51 s here)
    max_loading_s: float = 300.0

    def open_idle_limit_s(self, upstream_prefill_s: float) -> float:
        """How long a session opened here may wait for its first step: open_idle_timeout_s plus
        UPSTREAM_PREFILL_SLACK x `upstream_prefill_s` (the blocks before its span over its batch x max_length tokens,
        priced by this server's measured profile: the earlier servers compute its prompt first), the added part at
        most session_idle_timeout_s - open_idle_timeout_s (what one step already buys a peer: no new hold)."""
        room = max(0.0, self.session_idle_timeout_s - self.open_idle_timeout_s)
        return self.open_idle_timeout_s + min(UPSTREAM_PREFILL_SLACK * max(0.0, upstream_prefill_s), room)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))  # torch.float32 -> "float32" (or refused)
        if self.quant not in QUANT_NAMES:
            raise ValueError(f"quant must be one of {', '.join(QUANT_NAMES)}, got {self.quant!r}")
        if self.kv_dtype not in KV_DTYPE_NAMES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPE_NAMES)}, got {self.kv_dtype!r}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        for name in ("cache_bytes", "max_sessions", "max_length_tokens", "max_batch", "max_message_bytes",
                     "max_sessions_per_peer", "max_peer_bytes_in_flight", "max_concurrent_rpcs",
                     "max_request_tokens", "max_attention_cost", "open_idle_timeout_s", "session_idle_timeout_s",
                     "frame_idle_timeout_s",
                     "push_timeout_s", "max_train_request_bytes", "max_train_total_bytes", "max_lora_rank",
                     "max_lora_layers", "inbox_steps", "push_room_wait_s", "max_steps_ahead", "max_push_channels",
                     "trim_refused_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_train_request_bytes > self.max_train_total_bytes:
            raise ValueError(f"max_train_request_bytes ({self.max_train_request_bytes}) must be at most "
                             f"max_train_total_bytes ({self.max_train_total_bytes}): such a request would never fit")
        for name in ("join_settle_s", "drain_timeout_s", "rebalance_period_s", "train_admission_wait_s",
                     "max_loading_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be >= 0 (0 = off), got {self.prefix_cache_bytes}")
        if self.resume_grace_s < 0:
            raise ValueError(f"resume_grace_s must be >= 0, got {self.resume_grace_s}")
        if not 0 < self.max_peer_cache_fraction <= 1:
            raise ValueError(f"max_peer_cache_fraction must be in (0, 1], got {self.max_peer_cache_fraction}")
        if not self.announce_period_s < self.record_ttl_s <= MAX_RECORD_TTL_S:
            raise ValueError(
                f"record_ttl_s ({self.record_ttl_s}) must exceed announce_period_s ({self.announce_period_s}) and be "
                f"at most MAX_RECORD_TTL_S ({MAX_RECORD_TTL_S})"
            )
        if self.blocks is None and self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.placement not in ("petals", "cg-bprr"):
            raise ValueError(f"placement must be 'petals' or 'cg-bprr', got {self.placement!r}")
        if self.reachability not in ("auto", "direct", "relayed"):
            raise ValueError(f"reachability must be 'auto', 'direct' or 'relayed', got {self.reachability!r}")


@dataclass(frozen=True)
class ClientConfig:
    initial_peers: tuple[str, ...] = ()
    dht_prefix: str | None = None  # default: from the model directory's name
    servers: tuple[str, ...] = ()  # direct server addresses (host:port), bypassing the DHT
    dtype: str = "auto"  # dtype of hidden states on the wire and of the client's modules (DTYPE_NAMES, or a torch dtype)
    quant: str = "auto"  # the client's LM head and embeddings (QUANT_NAMES, swarmlm/model/quant.py)
    # route only through servers computing their checkpoint's values: announcing quant "none" (not int8 / int4) and
    # caches of their blocks' dtype (not float16 K/V beside float32 blocks: ServerRecord.narrowed_cache)
    require_full_precision: bool = False
    # hidden states on the wire (swarmlm/wire/compress.py): "float32" (exact), "float16", "bfloat16", "int8"
    # (blockwise), or "auto": float32 on loopback and fast links (>= 500 Mbit/s, or not measured yet), float16,
    # int8 below 50 Mbit/s
    wire_dtype: str = "auto"
    threads: int = 1  # torch threads for the client's embeddings and LM head
    # concurrent sessions of one client process share ONE LM-head matmul (swarmlm/client/head_batcher.py): a call
    # waits for the other recently seen sessions (of the last head time); fraction 0 = every session runs its own head
    head_batch_wait: StragglerWait = StragglerWait(fraction=1.0, max_s=1.0)
    wait_for_blocks_s: float = 30.0  # how long to wait for missing blocks before failing
    # while servers announce every missing block as loading (a spare moving onto them: 30-51 s for llama-8b here),
    # wait up to this long in all (if longer than wait_for_blocks_s): a stuck or hostile loader holds us no longer
    wait_for_loading_s: float = 300.0
    step_timeout_s: float = 60.0  # one step through one server, at most (see hang_factor)
    # a server is hung (alive, not answering) when a step makes no progress there for hang_factor x its announced
    # compute time for that step, plus hang_floor_s (at most step_timeout_s): it is banned and failed over
    hang_factor: float = 20.0
    hang_floor_s: float = 5.0
    connect_timeout_s: float = 5.0
    max_retries: int = 3  # failovers within one step before giving up
    # training (client/autograd.py): rows x tokens of one Forward / Backward request; a longer batch is split by
    # rows into chunks of at most this (one row is never split: a longer sequence goes whole)
    train_chunk_tokens: int = 2048
    active_adapter: str | None = None  # a LoRA adapter servers pre-load (server --adapters): only they are routed to
    ban_base_s: float = 2.0  # a failed server is avoided for this long, doubling on each repeat failure
    ban_max_s: float = 60.0
    routing: str = "waiting-aware"  # "shortest" | "waiting-aware" (planner.routing.WaitingAwareRouter)
    records_max_age_s: float = 2.0  # before routing a session, re-read the swarm (records, load) if older than this
    max_message_bytes: int = 64 << 20
    # Chunked prefill and decode-first transmission (swarmlm/client/chunking.py, swarmlm/wire/links.py).
    # tokens per prefill message: None = auto (link + compute), 0 = one message. Auto by default: -10..-45 % time
    # per output token where long prompts meet decodes on 20 Mbit/s-1 Gbit/s links, neutral on loopback
    # (docs/RESULTS-molink.md).
    prefill_chunk_tokens: int | None = None
    chunk_rule: ChunkRule = ChunkRule()  # the automatic size's bounds and costs
    decode_first: bool = True  # decode messages pass waiting prefill chunks on each link (False: arrival order)
    max_decode_burst: int = 8  # decode messages in a row that may pass a waiting prefill chunk (fairness)
    prefill_window: int = 2  # with chunking: prefill chunks per link written and not yet answered
    assumed_bandwidth_bps: float = 1e9  # a link's bandwidth until the client has measured it (bits per second)
    # server-to-server push (swarmlm/server/push.py): each server sends its output straight to the next one, a
    # token crosses N + 1 links instead of 2N; the client still gets every output (for failover). "auto": on the
    # routes where the performance model predicts it saves time from the measured RTTs (PerfModel.push_pays);
    # True / False are taken as "on" / "off"
    push: PushMode = "auto"
    # a pushed route's plain decode steps: the servers keep the route, so the client writes a STEP to its first
    # server and nothing else per token (protocol 4, docs/PROTOCOL.md "Kept routes"); False = every pushed step names
    # the whole route again (a REQUEST with its targets)
    keep_routes: bool = True
    swarm_key: bytes | None = field(default=None, repr=False)  # a private swarm's shared secret (swarm/private.py)
    # Inference streams on a server's framed step port when its Info announces one (wire/frames.py); decode steps
    # then run from the caller's thread, and a connection whose stream ended cleanly is kept for the next session
    # (client/channels.py). Faster than gRPC and less CPU per step on a free machine (docs/RESULTS-hop.md, round 6
    # and 7); False = gRPC's Inference call
    frames: bool = True
    # a relayed decode step's hops on framed streams in one C call (client/relay.py, kernels/chain.c); False: in
    # Python (the same checks and outcome, ~N x 0.1 ms more per token: docs/RESULTS-hop.md round 19; for A/B runs)
    relay_in_c: bool = True
    # start sessions from prefixes the servers keep from earlier sessions and keep each finished session's prefix
    # (client/prefix.py); False = every session prefills its whole prompt
    prefix_cache: bool = True
    # private swarms only: every member holding the swarm key shares one prefix scope (their entries are visible to
    # each other); otherwise the scope is this client's own random secret
    prefix_share: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))  # torch.float32 -> "float32" (or refused)
        if self.quant not in QUANT_NAMES:
            raise ValueError(f"quant must be one of {', '.join(QUANT_NAMES)}, got {self.quant!r}")
        if self.prefix_share and self.swarm_key is None:
            raise ValueError("prefix_share=True needs a private swarm (swarm_key): in an open swarm a shared prefix "
                             "cache lets any client plant wrong entries for the others")
        if self.routing not in ("shortest", "waiting-aware"):
            raise ValueError(f"routing must be 'shortest' or 'waiting-aware', got {self.routing!r}")
        if self.wire_dtype not in WIRE_DTYPE_NAMES:
            raise ValueError(f"wire_dtype must be one of {', '.join(WIRE_DTYPE_NAMES)}, got {self.wire_dtype!r}")
        if self.threads < 1 or self.max_retries < 0:
            raise ValueError("threads must be >= 1 and max_retries >= 0")
        if self.train_chunk_tokens < 1:
            raise ValueError(f"train_chunk_tokens must be >= 1, got {self.train_chunk_tokens}")
        if not (self.step_timeout_s > 0 and self.hang_factor > 0 and self.hang_floor_s > 0):
            raise ValueError(f"step_timeout_s ({self.step_timeout_s}), hang_factor ({self.hang_factor}) and "
                             f"hang_floor_s ({self.hang_floor_s}) must be > 0")
        if self.records_max_age_s < 0:
            raise ValueError(f"records_max_age_s must be >= 0, got {self.records_max_age_s}")
        if self.wait_for_blocks_s < 0 or self.wait_for_loading_s < 0:
            raise ValueError(f"wait_for_blocks_s ({self.wait_for_blocks_s}) and wait_for_loading_s "
                             f"({self.wait_for_loading_s}) must be >= 0")
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < 0:
            raise ValueError(f"prefill_chunk_tokens must be None (auto), 0 (off) or positive, got {self.prefill_chunk_tokens}")
        if self.max_decode_burst < 1 or self.prefill_window < 1:
            raise ValueError(f"max_decode_burst ({self.max_decode_burst}) and prefill_window ({self.prefill_window}) must be >= 1")
        if self.assumed_bandwidth_bps <= 0:
            raise ValueError(f"assumed_bandwidth_bps must be > 0, got {self.assumed_bandwidth_bps}")
        if isinstance(self.push, bool):
            object.__setattr__(self, "push", "on" if self.push else "off")
        if self.push not in PUSH_MODES:
            raise ValueError(f"push must be one of {', '.join(PUSH_MODES)} (or a bool), got {self.push!r}")
