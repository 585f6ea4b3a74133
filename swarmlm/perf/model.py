"""The one performance model shared by the planner, the client's router and the simulator.

BPRR model (arXiv 2512.21884, section "performance models"), all times in seconds, sizes in bytes:

    prefill hop  = tI_cj + k * (a_j * l_in + b_j)          # client -> server j -> client, k blocks, prompt
    decode hop   = t_cj  + k * tau_j                       # one generated token
    hop cost     = prefill hop + (l_out - 1) * decode hop  # BPRR edge weight
    request time = sum of hop costs over the route's spans

The client relays hidden states between consecutive servers (as Petals does), so only client<->server links
matter: tI_cj = RTT_cj + 2 * l_in * h / bw_cj and t_cj = RTT_cj + 2 * h / bw_cj, h = hidden bytes per token
(0 by default: the paper's RTTs already include the small per-token payload).

Compute contention (our addition; the paper measured GPU servers, whose step time does not grow with load): a server
running b sessions at once steps each of them in tau_j * f_j(b) per block, f_j(b) = the cost of one batched decode
forward of b rows over one of 1 row (`ComputeProfile.load_factor`), piecewise linear through the rows a server's
profile measured (1, 4 and 16: `CONTENTION_ROWS`). A profile without those measurements has f = 1 (the paper).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from swarmlm.types import Span


def _check_nonneg(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{owner}.{name} must be a finite number >= 0, got {value!r}")


# What one server-to-server push costs beyond the relayed message it replaces (its own unary RPC, handed to the
# next server's session stream). Measured on loopback, where the links save nothing: 4 servers pushed 170.9 vs
# 169.2 ms per token relayed (docs/RESULTS-perf.md), ~0.6 ms per push; rounded up so that push is chosen only
# where the links clearly pay for it.
PUSH_HOP_S = 0.001

CONTENTION_ROWS = (4, 16)  # decode rows (concurrent sessions) at which a profile measures a batched forward


@dataclass(frozen=True)
class ComputeProfile:
    """Per-block compute time of one server, fitted from measurements (linear in blocks and in l_in), and how a
    decode step slows down with the sessions the server runs at once (`load_factor`)."""

    prefill_a_s: float  # seconds per block per prompt token
    prefill_b_s: float  # seconds per block per prompt (fixed part)
    decode_s: float  # seconds per block per generated token, one session alone
    # seconds per block of ONE decode forward of 4 / 16 rows (CONTENTION_ROWS), i.e. 4 / 16 sessions batched
    # together; 0 = not measured (the paper's model: step time independent of load)
    decode_4rows_s: float = 0.0
    decode_16rows_s: float = 0.0

    def __post_init__(self) -> None:
        _check_nonneg("ComputeProfile", prefill_a_s=self.prefill_a_s, prefill_b_s=self.prefill_b_s,
                      decode_s=self.decode_s, decode_4rows_s=self.decode_4rows_s,
                      decode_16rows_s=self.decode_16rows_s)
        if (self.decode_4rows_s > 0) != (self.decode_16rows_s > 0):
            raise ValueError("ComputeProfile: decode_4rows_s and decode_16rows_s are measured together (both > 0 or "
                             f"both 0), got {self.decode_4rows_s} and {self.decode_16rows_s}")

    def prefill_s(self, l_in: int) -> float:
        """Seconds to run one block over a prompt of `l_in` tokens."""
        return self.prefill_a_s * l_in + self.prefill_b_s

    def prefill_step_terms(self, blocks: int, rows: int) -> tuple[float, float]:
        """A prefill step of `rows` sequences over `blocks` blocks: (seconds per new token, fixed seconds per step)."""
        return self.prefill_a_s * rows * blocks, self.prefill_b_s * blocks

    def step_s(self, blocks: int, rows: int, tokens: int) -> float:
        """One step of `rows` x `tokens` new tokens over `blocks` blocks, alone (a decode's rows unbatched: a bound)."""
        per_token, fixed = self.prefill_step_terms(blocks, rows)
        return self.decode_s * rows * blocks if tokens == 1 else per_token * tokens + fixed

    def extend_s(self, tokens: int) -> float:
        """Seconds of one block for a step of `tokens` new tokens of one session past its cache (a speculative
        pass): the first at the decode cost, each further one at the prompt's marginal cost (a_j)."""
        return self.decode_s + self.prefill_a_s * (tokens - 1)

    @property
    def contended(self) -> bool:
        """True if step times grow with the sessions the server runs (f is not 1 everywhere)."""
        return self.decode_s > 0 and self.decode_4rows_s > 0

    def load_factor(self, sessions: int) -> float:
        """f(b): a step's compute with `sessions` (b) running at once over one session's alone, f(1) = 1.

        Piecewise linear through (1, 1), (4, f4), (16, f16), the measured cost of one forward of that many rows
        over one row (the sessions' steps batched; sessions out of lockstep wait for each other's rounds on top,
        which this leaves out), extended past 16 with the last segment's slope. Clamped so that noise in the
        measurement cannot make more sessions cheaper (f non-decreasing) or worse than no batching (f(b) <= b).
        """
        if sessions <= 1 or not self.contended:
            return 1.0
        (r1, r2) = CONTENTION_ROWS
        f1 = min(max(self.decode_4rows_s / self.decode_s, 1.0), float(r1))
        f2 = min(max(self.decode_16rows_s / self.decode_s, f1), float(r2))
        if sessions <= r1:
            return 1.0 + (f1 - 1.0) * (sessions - 1) / (r1 - 1)
        return min(f1 + (f2 - f1) * (sessions - r1) / (r2 - r1), float(sessions))

    @classmethod
    def no_batching(cls, prefill_a_s: float, prefill_b_s: float, decode_s: float) -> "ComputeProfile":
        """A profile whose sessions share the compute without any batching gain: f(b) = b."""
        r1, r2 = CONTENTION_ROWS
        return cls(prefill_a_s, prefill_b_s, decode_s, r1 * decode_s, r2 * decode_s)


@dataclass(frozen=True)
class ModelSpec:
    """What placement needs to know about the model: block count and memory footprints."""

    num_blocks: int  # L, transformer blocks
    block_bytes: float  # s_m, weights of one block
    cache_bytes_per_session_block: float  # s_c, attention cache of one session (l_in_max + l_max tokens) in one block
    hidden_bytes_per_token: float = 0.0  # h, activations sent per token per hop (0: folded into the RTT)
    session_tokens: int = 0  # l_in_max + l_max that s_c was sized for (0: unknown); lets Petals' 4096-token rule scale

    def __post_init__(self) -> None:
        if not isinstance(self.num_blocks, int) or self.num_blocks < 1:
            raise ValueError(f"ModelSpec.num_blocks must be an integer >= 1, got {self.num_blocks!r}")
        _check_nonneg("ModelSpec", block_bytes=self.block_bytes,
                      cache_bytes_per_session_block=self.cache_bytes_per_session_block,
                      hidden_bytes_per_token=self.hidden_bytes_per_token, session_tokens=self.session_tokens)
        if self.block_bytes <= 0 or self.cache_bytes_per_session_block <= 0:
            raise ValueError("ModelSpec.block_bytes and cache_bytes_per_session_block must be > 0")

    def cache_bytes_per_token_block(self) -> float | None:
        return self.cache_bytes_per_session_block / self.session_tokens if self.session_tokens else None

    @classmethod
    def from_config(cls, config: object, l_in_max: int, l_max: int, dtype_bytes: float = 2.0,
                    weight_bytes_per_param: float | None = None) -> "ModelSpec":
        """Sizes from a transformers config: s_c = 2 * kv_dim * (l_in_max + l_max) * dtype_bytes.

        kv_dim = num_key_value_heads * head_dim (grouped-query attention keeps fewer K/V heads than query heads).
        Block weights are estimated from the usual decoder shapes (attention + MLP), `weight_bytes_per_param`
        bytes each (defaults to dtype_bytes; 0.5 for NF4).
        """
        hidden = int(getattr(config, "hidden_size", 0) or getattr(config, "n_embd", 0))
        layers = int(getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 0))
        heads = int(getattr(config, "num_attention_heads", 0) or getattr(config, "n_head", 0) or 1)
        kv_heads = int(getattr(config, "num_key_value_heads", 0) or heads)
        head_dim = int(getattr(config, "head_dim", 0) or hidden // heads)
        inter = int(getattr(config, "intermediate_size", 0) or getattr(config, "n_inner", 0) or 4 * hidden)
        if hidden <= 0 or layers <= 0:
            raise ValueError("config has no hidden_size/num_hidden_layers")
        kv_dim = kv_heads * head_dim
        # q and o are hidden x hidden, k and v are hidden x kv_dim; gated MLPs (Llama) have 3 matrices, others 2
        mlp_mats = 3 if getattr(config, "hidden_act", "") in ("silu", "swiglu") else 2
        params = 2 * hidden * hidden + 2 * hidden * kv_dim + mlp_mats * hidden * inter
        wbytes = dtype_bytes if weight_bytes_per_param is None else weight_bytes_per_param
        tokens = l_in_max + l_max
        return cls(num_blocks=layers, block_bytes=float(params * wbytes),
                   cache_bytes_per_session_block=float(2 * kv_dim * tokens * dtype_bytes),
                   hidden_bytes_per_token=float(hidden * dtype_bytes), session_tokens=tokens)


@dataclass(frozen=True)
class ServerSpec:
    name: str
    memory_bytes: float  # M_j, GPU memory available for blocks and caches
    profile: ComputeProfile
    cluster: str | None = None  # network location when RTTs come from clusters

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("ServerSpec.name must be non-empty")
        _check_nonneg(f"server {self.name}", memory_bytes=self.memory_bytes)


@dataclass(frozen=True)
class ClientSpec:
    name: str
    cluster: str | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("ClientSpec.name must be non-empty")


@dataclass(frozen=True)
class Workload:
    input_tokens: int  # l_in, prompt length
    output_tokens: int  # l_out, generated tokens (>= 1)
    concurrency: int | None = None  # R, concurrent sessions to plan for
    arrival_rate: float | None = None  # lambda, requests per second over all clients (R derived from it)

    def __post_init__(self) -> None:
        if self.input_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"Workload needs input_tokens >= 1 and output_tokens >= 1, "
                             f"got {self.input_tokens} and {self.output_tokens}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"Workload.concurrency must be >= 1, got {self.concurrency}")
        if self.arrival_rate is not None and not self.arrival_rate > 0:
            raise ValueError(f"Workload.arrival_rate must be > 0, got {self.arrival_rate}")


class Network:
    """Symmetric links between named nodes: RTT (s) and bandwidth (bits/s).

    Lookup order: explicit link, then cluster rule (intra/inter), then defaults. Unknown pair without
    a default: KeyError naming the pair. Mutable so the live client can record measured RTTs.
    """

    def __init__(self, default_rtt_s: float | None = None, default_bandwidth_bps: float = math.inf) -> None:
        # explicit links, stored under both (a, b) and (b, a): one dict probe per lookup, no key sorting
        self._rtt: dict[tuple[str, str], float] = {}
        self._bw: dict[tuple[str, str], float] = {}
        self._cluster: dict[str, str] = {}
        self._intra = (0.0, math.inf)  # (rtt_s, bandwidth_bps) inside a cluster
        self._inter: tuple[float, float] | None = None
        self._pair_rtt: dict[tuple[str, str], float] = {}  # cluster pair (both orders) -> RTT overriding _inter
        self._default_rtt_s = default_rtt_s
        self._default_bw = default_bandwidth_bps
        self.version = 0  # bumped on every change, so caches of derived times know when to drop

    @property
    def default_rtt_s(self) -> float | None:
        return self._default_rtt_s

    @default_rtt_s.setter
    def default_rtt_s(self, value: float | None) -> None:
        self._default_rtt_s = value
        self.version += 1

    def set_link(self, a: str, b: str, rtt_s: float, bandwidth_bps: float | None = None) -> None:
        _check_nonneg(f"link {a}-{b}", rtt_s=rtt_s)
        self._rtt[a, b] = self._rtt[b, a] = float(rtt_s)
        if bandwidth_bps is not None:
            if not bandwidth_bps > 0:
                raise ValueError(f"link {a}-{b}: bandwidth_bps must be > 0, got {bandwidth_bps}")
            self._bw[a, b] = self._bw[b, a] = float(bandwidth_bps)
        self.version += 1

    def set_bandwidth(self, a: str, b: str, bandwidth_bps: float) -> None:
        if not bandwidth_bps > 0:
            raise ValueError(f"link {a}-{b}: bandwidth_bps must be > 0, got {bandwidth_bps}")
        self._bw[a, b] = self._bw[b, a] = float(bandwidth_bps)
        self.version += 1

    @classmethod
    def from_matrix(cls, rtt_s: Mapping[str, Mapping[str, float]],
                    bandwidth_bps: Mapping[str, Mapping[str, float]] | None = None,
                    default_rtt_s: float | None = None, default_bandwidth_bps: float = math.inf) -> "Network":
        """Nested dict {a: {b: rtt}}; one direction is enough (symmetric)."""
        net = cls(default_rtt_s, default_bandwidth_bps)
        for a, row in rtt_s.items():
            for b, value in row.items():
                net.set_link(a, b, value)
        for a, row in (bandwidth_bps or {}).items():
            for b, value in row.items():
                net.set_bandwidth(a, b, value)
        return net

    @classmethod
    def from_clusters(cls, cluster_of: Mapping[str, str], intra_rtt_s: float, inter_rtt_s: float,
                      intra_bandwidth_bps: float = math.inf, inter_bandwidth_bps: float = math.inf,
                      pair_rtt_s: Mapping[tuple[str, str], float] | None = None) -> "Network":
        """Every node in a cluster; RTT and bandwidth depend only on same/different cluster.

        `pair_rtt_s` overrides the inter-cluster RTT for specific cluster pairs.
        """
        _check_nonneg("clusters", intra_rtt_s=intra_rtt_s, inter_rtt_s=inter_rtt_s)
        net = cls()
        net._cluster = dict(cluster_of)
        net._intra = (float(intra_rtt_s), float(intra_bandwidth_bps))
        net._inter = (float(inter_rtt_s), float(inter_bandwidth_bps))
        for (ca, cb), v in (pair_rtt_s or {}).items():
            net._pair_rtt[ca, cb] = net._pair_rtt[cb, ca] = float(v)
        return net

    def link(self, a: str, b: str) -> tuple[float, float]:
        """(rtt_s, bandwidth_bps) of the link a-b: explicit link, then cluster rule, then defaults."""
        if a == b:
            return 0.0, math.inf
        rtt = self._rtt.get((a, b))
        bw = self._bw.get((a, b))
        if rtt is not None and bw is not None:
            return rtt, bw
        cluster = self._cluster_link(a, b)
        if rtt is None:
            rtt = cluster[0] if cluster is not None else self._default_rtt_s
            if rtt is None:
                raise KeyError(f"no RTT known between {a!r} and {b!r}")
        if bw is None:
            bw = cluster[1] if cluster is not None else self._default_bw
        return rtt, bw

    def _cluster_link(self, a: str, b: str) -> tuple[float, float] | None:
        if self._inter is None:
            return None
        ca, cb = self._cluster.get(a), self._cluster.get(b)
        if ca is None or cb is None:
            return None
        if ca == cb:
            return self._intra
        return self._pair_rtt.get((ca, cb), self._inter[0]), self._inter[1]

    def rtt_s(self, a: str, b: str) -> float:
        return self.link(a, b)[0]

    def bandwidth_bps(self, a: str, b: str) -> float:
        if a == b:
            return math.inf
        bw = self._bw.get((a, b))
        if bw is not None:
            return bw
        cluster = self._cluster_link(a, b)
        return cluster[1] if cluster is not None else self._default_bw

    def known_rtt_s(self, a: str, b: str) -> float | None:
        """The RTT of a-b if a link or the cluster rule gives it (measured or from a topology), else None: the
        default stands in for links nobody measured, which a decision may rather estimate its own way."""
        if a == b:
            return 0.0
        rtt = self._rtt.get((a, b))
        if rtt is None and (cluster := self._cluster_link(a, b)) is not None:
            rtt = cluster[0]
        return rtt

    def has_rtt(self, a: str, b: str) -> bool:
        try:
            self.link(a, b)
        except KeyError:
            return False
        return True


class PerfModel:
    """Predicts hop and request times from per-server profiles and a Network. No Topology needed.

    The live client builds one from announced profiles and measured RTTs (`set_profile`, `network.set_link`);
    the planner and the simulator build one from a topology file.
    """

    def __init__(self, profiles: Mapping[str, ComputeProfile], network: Network,
                 hidden_bytes_per_token: float = 0.0) -> None:
        self.profiles: dict[str, ComputeProfile] = dict(profiles)
        self.network = network
        self.hidden_bytes_per_token = hidden_bytes_per_token
        # (client, server, l_in, l_out) -> hop cost terms; dropped when profiles or the network change
        self._terms: dict[tuple[str, str, int, int], tuple[float, float]] = {}
        self._terms_version = network.version

    @classmethod
    def from_specs(cls, servers: Iterable[ServerSpec], network: Network, model: ModelSpec | None = None) -> "PerfModel":
        return cls({s.name: s.profile for s in servers}, network, model.hidden_bytes_per_token if model else 0.0)

    def set_profile(self, server: str, profile: ComputeProfile) -> None:
        self.profiles[server] = profile
        self._terms.clear()

    # -- links --------------------------------------------------------------------------------------------
    def transfer_s(self, a: str, b: str, nbytes: float) -> float:
        """One-way delivery of `nbytes` from a to b: RTT/2 + serialisation."""
        bw = self.network.bandwidth_bps(a, b)
        return self.network.rtt_s(a, b) / 2 + (8.0 * nbytes / bw if nbytes and math.isfinite(bw) else 0.0)

    def round_trip_s(self, client: str, server: str, tokens: int) -> float:
        """tI_cj (tokens = l_in) or t_cj (tokens = 1): hidden states to the server and back.

        Same as transfer_s(client, server, n) + transfer_s(server, client, n), with one lookup per link
        (the planner calls this ~10^5 times on 1,000-server topologies)."""
        rtt, bw = self.network.link(client, server)
        nbytes = tokens * self.hidden_bytes_per_token
        return rtt + (2 * 8.0 * nbytes / bw if nbytes and math.isfinite(bw) else 0.0)

    # -- hops ---------------------------------------------------------------------------------------------
    def prefill_hop_s(self, client: str, server: str, blocks: int, l_in: int, sessions: int = 1) -> float:
        """The prompt through k blocks of `server` while it runs `sessions` sessions (this one included)."""
        profile = self.profiles[server]
        return self.round_trip_s(client, server, l_in) + blocks * profile.prefill_s(l_in) * profile.load_factor(sessions)

    def decode_hop_s(self, client: str, server: str, blocks: int, sessions: int = 1) -> float:
        """One token through k blocks of `server` while it runs `sessions` sessions (this one included)."""
        profile = self.profiles[server]
        return self.round_trip_s(client, server, 1) + blocks * profile.decode_s * profile.load_factor(sessions)

    def load_factor(self, server: str, sessions: int) -> float:
        """f(b) of `server`: its compute with `sessions` running at once over one session's alone."""
        return self.profiles[server].load_factor(sessions)

    def hop_cost_s(self, client: str, server: str, blocks: int, l_in: int, l_out: int) -> float:
        """BPRR edge weight: (tI + (l_out-1) t) + (tauI + (l_out-1) tau) * k."""
        fixed_s, per_block_s = self.hop_cost_terms(client, server, l_in, l_out)
        return fixed_s + per_block_s * blocks

    def hop_cost_terms(self, client: str, server: str, l_in: int, l_out: int) -> tuple[float, float]:
        """The hop cost is affine in the block count k: (fixed_s, per_block_s) with cost = fixed + per_block * k.
        fixed = tI + (l_out-1) t (links), per_block = tauI(l_in) + (l_out-1) tau (compute, one session alone: a
        router multiplies it by `load_factor(server, b)` for a server running b sessions). Memoised: the
        planner asks for every (client, server) pair, sometimes twice."""
        if self._terms_version != self.network.version:
            self._terms.clear()
            self._terms_version = self.network.version
        key = (client, server, l_in, l_out)
        terms = self._terms.get(key)
        if terms is None:
            profile = self.profiles[server]
            rtt, bw = self.network.link(client, server)
            fixed = l_out * rtt
            if self.hidden_bytes_per_token and math.isfinite(bw):
                # hidden states both ways: l_in tokens for the prompt, one per decode step
                fixed += 2 * 8.0 * self.hidden_bytes_per_token * (l_in + (l_out - 1)) / bw
            terms = self._terms[key] = (fixed, profile.prefill_s(l_in) + (l_out - 1) * profile.decode_s)
        return terms

    # -- whole requests -----------------------------------------------------------------------------------
    def ttft_s(self, client: str, spans: Sequence[Span], l_in: int) -> float:
        """Time to first token: the prompt through every hop."""
        return sum(self.prefill_hop_s(client, s.server_id, s.length, l_in) for s in spans)

    def decode_step_s(self, client: str, spans: Sequence[Span], push: bool = False) -> float:
        """One generated token through every hop (steady-state time per token); `push`: each server sends its
        output straight to the next one (server-to-server push, `push_saving_s`)."""
        step = sum(self.decode_hop_s(client, s.server_id, s.length) for s in spans)
        return step - self.push_saving_s(client, spans) if push else step

    def pass_s(self, client: str, spans: Sequence[Span], tokens: int, push: bool = False) -> float:
        """One step of `tokens` new tokens (a speculative pass verifying tokens - 1 drafts) through every hop:
        round trips with `tokens` hidden states plus compute (`ComputeProfile.step_s`); pass_s(..., 1) is the
        decode step."""
        step = sum(self.round_trip_s(client, s.server_id, tokens) + s.length * self.profiles[s.server_id].extend_s(tokens)
                   for s in spans)
        return step - self.push_saving_s(client, spans) if push else step

    # -- server-to-server push ------------------------------------------------------------------------------
    def push_saving_s(self, client: str, spans: Sequence[Span]) -> float:
        """Seconds one decode token saves on `spans` when every server pushes its output to the next one.

        Relayed, a token makes a round trip to every server: sum_j rt_cj(1). Pushed, it goes one way along the
        chain, client -> s_1 -> ... -> s_N -> client, and each of the N - 1 pushes costs PUSH_HOP_S more than the
        relayed message it replaces. A server-to-server RTT nobody measured is taken as the larger of the client's
        RTTs to the two servers (the servers are no closer to each other than to the client: the cautious guess).
        <= 0: push does not pay (always so for one server)."""
        if len(spans) < 2:
            return 0.0
        ids = [s.server_id for s in spans]
        h = self.hidden_bytes_per_token
        relayed = sum(self.round_trip_s(client, sid, 1) for sid in ids)
        pushed = self.transfer_s(client, ids[0], h) + self.transfer_s(ids[-1], client, h)
        for a, b in zip(ids, ids[1:]):
            rtt = self.network.known_rtt_s(a, b)
            if rtt is None:
                rtt = max(self.network.rtt_s(client, a), self.network.rtt_s(client, b))
            bw = self.network.bandwidth_bps(a, b)
            pushed += rtt / 2 + (8.0 * h / bw if h and math.isfinite(bw) else 0.0) + PUSH_HOP_S
        return relayed - pushed

    def push_pays(self, client: str, spans: Sequence[Span]) -> bool:
        """The `push="auto"` rule: push where the model predicts it saves time per token."""
        return self.push_saving_s(client, spans) > 0

    def request_time_s(self, client: str, spans: Sequence[Span], l_in: int, l_out: int) -> float:
        return self.ttft_s(client, spans, l_in) + (l_out - 1) * self.decode_step_s(client, spans)

    def per_token_s(self, client: str, spans: Sequence[Span], l_in: int, l_out: int) -> float:
        """The paper's metric: request time / l_out (TTFT amortised over the generated tokens)."""
        return self.request_time_s(client, spans, l_in, l_out) / l_out
