"""Block placement: which contiguous block range each server holds.

One interface for every algorithm (the registry, planner/plan.py PLACEMENTS, adds planner/milp.py's):

    PLACEMENTS[name](topology, concurrency, options) -> PlacementResult      # name in "petals", "cg-bprr", "milp"

plus the online pieces the live swarm uses: `choose_concurrency` (R from the arrival rate), `is_feasible`
(the paper's feasibility condition) and `choose_range` (the block range of one joining server).
Block ranges are half-open and count from 0; the paper's 1-based a_j is our start + 1.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable, Iterable, Literal, Mapping, Sequence

from swarmlm.errors import PlanningError
from swarmlm.perf.model import ClientSpec, ModelSpec, PerfModel, ServerSpec
from swarmlm.planner.topology import Topology
from swarmlm.types import BlockRange, Span

Placement = dict[str, BlockRange]
GIB = 2**30
BLOOM_BLOCK_BYTES = 1.32e9  # the model Petals' 2 GiB reserve was tuned for (BLOOM-176B, NF4)


@dataclass(frozen=True)
class PlacementOptions:
    seed: int = 0  # petals: order in which servers join
    time_limit_s: float = 30.0  # milp: HiGHS wall-clock limit
    petals_cache_tokens: int = 4096  # petals: tokens of attention cache it reserves per block
    petals_reserve_bytes: float | None = None  # petals: memory kept free (None: 2 GiB scaled by block size)

    def __post_init__(self) -> None:
        if self.time_limit_s <= 0 or self.petals_cache_tokens < 1:
            raise ValueError("PlacementOptions: time_limit_s must be > 0 and petals_cache_tokens >= 1")


@dataclass(frozen=True)
class PlacementResult:
    ranges: Placement  # server -> [start, end); servers that hold nothing are absent
    solve_s: float = 0.0  # wall-clock time of the algorithm
    gap: float | None = None  # milp: relative optimality gap reported by HiGHS (0 = proven optimal)
    objective_s: float | None = None  # milp: total request time of the R planned requests
    routes: tuple[tuple[str, tuple[Span, ...]], ...] = ()  # milp: (client, spans) per planned request
    bound_s: float | None = None  # cg-bprr: Theorem-2 upper bound on a request's per-token decode time
    notes: tuple[str, ...] = field(default=())


PlacementFn = Callable[[Topology, int, PlacementOptions], PlacementResult]


# ---------------------------------------------------------------------------------------------------------
# memory rules
# ---------------------------------------------------------------------------------------------------------

def blocks_for_concurrency(memory_bytes: float, model: ModelSpec, concurrency: int) -> int:
    """CG-BPRR step 1: m_j = min(floor(M_j / (s_m + s_c R)), L) -- room for R sessions on every block."""
    per_block = model.block_bytes + model.cache_bytes_per_session_block * concurrency
    return min(int(memory_bytes // per_block), model.num_blocks)


def session_capacity(memory_bytes: float, model: ModelSpec, blocks: int) -> int:
    """s_j = floor((M_j - s_m m_j) / (s_c m_j)): sessions a server can host through all of its m_j blocks."""
    if blocks <= 0:
        return 0
    return max(0, int((memory_bytes - model.block_bytes * blocks) // (model.cache_bytes_per_session_block * blocks)))


def cache_slots(memory_bytes: float, model: ModelSpec, blocks: int) -> int:
    """Block-sessions of cache left after the weights: the router's total_slots."""
    return max(0, int((memory_bytes - model.block_bytes * blocks) // model.cache_bytes_per_session_block))


def petals_num_blocks(memory_bytes: float, model: ModelSpec, options: PlacementOptions = PlacementOptions()) -> int:
    """Petals' rule: keep a reserve, then fit blocks each with a cache for `petals_cache_tokens` tokens."""
    reserve = options.petals_reserve_bytes
    if reserve is None:  # Petals reserves 2 GiB for BLOOM-176B; scale it with block size for smaller models
        reserve = 2 * GIB * min(1.0, model.block_bytes / BLOOM_BLOCK_BYTES)
    per_token = model.cache_bytes_per_token_block()
    cache = per_token * options.petals_cache_tokens if per_token else model.cache_bytes_per_session_block
    return max(0, min(int((memory_bytes - reserve) // (model.block_bytes + cache)), model.num_blocks))


def max_concurrency(servers: Iterable[ServerSpec], model: ModelSpec) -> int:
    """R_max = floor((sum M_j - s_m (L + |J|)) / (s_c (L + |J|))), the paper's memory cap on R."""
    servers = list(servers)
    n = model.num_blocks + len(servers)
    total = sum(s.memory_bytes for s in servers)
    return max(0, int((total - model.block_bytes * n) // (model.cache_bytes_per_session_block * n)))


def max_feasible_concurrency(servers: Iterable[ServerSpec], model: ModelSpec) -> int:
    """Largest R meeting the feasibility condition (0 if even R = 1 fails). The paper's closed-form R_max
    (`max_concurrency`) is a conservative estimate of it and can be 0 on small instances."""
    servers = list(servers)
    if not is_feasible(servers, model, 1):
        return 0
    lo, hi = 1, 2
    while is_feasible(servers, model, hi):  # m_j only shrinks as R grows: the condition is monotone
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if is_feasible(servers, model, mid) else (lo, mid)
    return lo


def is_feasible(servers: Iterable[ServerSpec], model: ModelSpec, concurrency: int) -> bool:
    """The paper's condition for CG-BPRR to cover the model: sum_j min(floor(M_j/(s_m + s_c R)), L) >= L."""
    return sum(blocks_for_concurrency(s.memory_bytes, model, concurrency) for s in servers) >= model.num_blocks


def choose_concurrency(arrival_rate: float, single_request_time_s: float, max_concurrency: int) -> int:
    """R = min(round(lambda T + sqrt(lambda T)), R_max): Little's law mean plus one Poisson standard deviation."""
    if arrival_rate < 0 or single_request_time_s < 0:
        raise ValueError("arrival_rate and single_request_time_s must be >= 0")
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 (memory for at least one session), got {max_concurrency}")
    load = arrival_rate * single_request_time_s
    return max(1, min(round(load + math.sqrt(load)), max_concurrency))


# ---------------------------------------------------------------------------------------------------------
# window choice (shared by the batch algorithms and `choose_range`)
# ---------------------------------------------------------------------------------------------------------

def lexicographic_window(values: Sequence[float], blocks: int) -> int:
    """Start of the window whose sorted values are lexicographically smallest (Petals' rule); ties: smallest start."""
    best_start, best_key = 0, None
    for a in range(len(values) - blocks + 1):
        key = sorted(values[a:a + blocks])
        if best_key is None or key < best_key:
            best_start, best_key = a, key
    return best_start


def demand_window(capacity: Sequence[int], demand: Sequence[float], blocks: int, target: int) -> int:
    """CG-BPRR step 4: among windows holding an under-covered block (capacity < target), the one with the
    largest total demand T_b; ties: smallest start. Callers ensure such a window exists."""
    n = len(capacity)
    prefix_t = [0.0]
    prefix_u = [0]
    for b in range(n):
        prefix_t.append(prefix_t[-1] + demand[b])
        prefix_u.append(prefix_u[-1] + (capacity[b] < target))
    best_start, best_sum = -1, 0.0
    for a in range(n - blocks + 1):
        if prefix_u[a + blocks] - prefix_u[a] > 0:
            total = prefix_t[a + blocks] - prefix_t[a]
            # strictly larger (beyond float noise) so that ties keep the smallest start
            if best_start < 0 or total > best_sum + 1e-12 * abs(best_sum):
                best_start, best_sum = a, total
    assert best_start >= 0, "demand_window called with every block covered"
    return best_start


# ---------------------------------------------------------------------------------------------------------
# petals
# ---------------------------------------------------------------------------------------------------------

def _throughput(server: ServerSpec) -> float:
    """Per-block throughput (tokens/s) Petals announces; a server with zero decode time counts as very fast."""
    return 1.0 / server.profile.decode_s if server.profile.decode_s > 0 else 1e12


def place_petals(topology: Topology, concurrency: int, options: PlacementOptions = PlacementOptions()) -> PlacementResult:
    """Servers join in a random (seeded) order; each takes the window whose sorted throughput is smallest."""
    del concurrency  # Petals does not plan for a load
    order = list(topology.servers)
    random.Random(options.seed).shuffle(order)
    throughput = [0.0] * topology.model.num_blocks
    ranges: Placement = {}
    for server in order:
        m = petals_num_blocks(server.memory_bytes, topology.model, options)
        if m == 0:
            continue
        start = lexicographic_window(throughput, m)
        ranges[server.name] = BlockRange(start, start + m)
        for b in range(start, start + m):
            throughput[b] += _throughput(server)
    return PlacementResult(ranges, notes=(f"join order seed {options.seed}",))


# ---------------------------------------------------------------------------------------------------------
# CG-BPRR
# ---------------------------------------------------------------------------------------------------------

def amortised_block_time_s(perf: PerfModel, clients: Sequence[ClientSpec], server: str, blocks: int) -> float:
    """t~_j = tau_j + max_c t_cj / m_j: per-block decode time with the worst client RTT spread over m_j blocks."""
    worst_rtt = max((perf.round_trip_s(c.name, server, 1) for c in clients), default=0.0)
    return perf.profiles[server].decode_s + worst_rtt / blocks


@dataclass
class _Coverage:
    """CG-BPRR state per block: C_b sessions hosted, T_b remaining amortised demand."""

    target: int  # R
    t_max: float  # per-block time of the virtual servers every block starts on
    capacity: list[int]
    demand: list[float]

    @classmethod
    def empty(cls, num_blocks: int, target: int, t_max: float) -> "_Coverage":
        return cls(target, t_max, [0] * num_blocks, [target * t_max] * num_blocks)

    def choose(self, blocks: int) -> int:
        if any(c < self.target for c in self.capacity):
            return demand_window(self.capacity, self.demand, blocks, self.target)
        return lexicographic_window(self.capacity, blocks)

    def add(self, rng: BlockRange, t_tilde: float, sessions: int) -> None:
        for b in range(rng.start, rng.end):
            self.demand[b] -= (self.t_max - t_tilde) * min(max(self.target - self.capacity[b], 0), sessions)
            self.capacity[b] += sessions

    def covered(self) -> bool:
        return all(c >= self.target for c in self.capacity)


def place_cg_bprr(topology: Topology, concurrency: int, options: PlacementOptions = PlacementOptions()) -> PlacementResult:
    """The paper's conservative greedy (steps 1-4) and its Theorem-2 bound."""
    model, R = topology.model, concurrency
    sized = [(s, blocks_for_concurrency(s.memory_bytes, model, R)) for s in topology.servers]
    sized = [(s, m) for s, m in sized if m > 0]
    if sum(m for _, m in sized) < model.num_blocks:
        raise PlanningError(f"cg-bprr: the model cannot be covered with room for R={R} sessions: servers hold "
                            f"{sum(m for _, m in sized)} of {model.num_blocks} blocks (lower R or add memory)")
    worst = topology.worst_round_trip_s  # max_c t_cj per server, computed once per topology
    t_tilde = {s.name: s.profile.decode_s + worst[s.name] / m for s, m in sized}  # t~_j = tau_j + max_c t_cj / m_j
    order = sorted(sized, key=lambda sm: t_tilde[sm[0].name])  # stable: ties keep file order
    cov = _Coverage.empty(model.num_blocks, R, max(t_tilde.values()) + 1.0)
    ranges: Placement = {}
    covered_after: int | None = None  # K: servers (in order) after which every block has capacity R
    for k, (server, m) in enumerate(order, start=1):
        start = cov.choose(m)
        ranges[server.name] = BlockRange(start, start + m)
        cov.add(ranges[server.name], t_tilde[server.name], session_capacity(server.memory_bytes, model, m))
        if covered_after is None and cov.covered():
            covered_after = k
    if covered_after is None:
        short = [b for b, c in enumerate(cov.capacity) if c < R]
        raise PlanningError(f"cg-bprr: target R={R} is infeasible: blocks {short[:10]}{'...' if len(short) > 10 else ''} "
                            f"can host only {min(cov.capacity)} sessions")
    return PlacementResult(ranges, bound_s=_theorem2_bound(order[:covered_after], t_tilde, model.num_blocks),
                           notes=(f"R={R}", f"K={covered_after} servers cover every block R times"))


def _theorem2_bound(first_k: Sequence[tuple[ServerSpec, int]], t_tilde: Mapping[str, float], num_blocks: int) -> float:
    """Per-token decode time bound with <= R concurrent requests (the authors' simulator, CG_BP.m):
    sum_{k<=K} t~_k m_k - tau_K (sum_{k<=K} m_k - L)."""
    total = sum(t_tilde[s.name] * m for s, m in first_k)
    last = first_k[-1][0]
    return total - last.profile.decode_s * (sum(m for _, m in first_k) - num_blocks)


# ---------------------------------------------------------------------------------------------------------
# one joining server (live swarm)
# ---------------------------------------------------------------------------------------------------------

def choose_range(joining: ServerSpec, existing: Mapping[str, tuple[ServerSpec, BlockRange]], model: ModelSpec,
                 algorithm: Literal["petals", "cg-bprr"] = "petals", *, concurrency: int = 1,
                 perf: PerfModel | None = None, clients: Sequence[ClientSpec] = (),
                 options: PlacementOptions = PlacementOptions()) -> BlockRange:
    """Block range for a server joining a live swarm, given what the others already hold.

    petals: its own block count; the window with the smallest sorted per-block throughput.
    cg-bprr: m from memory and R; replay the existing servers (in order of amortised per-block time) into the
    step-4 state, then pick the window with the largest uncovered demand (or the least-covered window when
    every block already hosts R sessions). Without `perf`, t~_j falls back to the decode time alone.
    """
    L = model.num_blocks
    if algorithm == "petals":
        m = petals_num_blocks(joining.memory_bytes, model, options)
        if m == 0:
            raise PlanningError(f"server {joining.name}: memory_bytes={joining.memory_bytes:.4g} cannot hold one block "
                                f"with Petals' reserve and {options.petals_cache_tokens}-token cache")
        throughput = [0.0] * L
        for name, (spec, rng) in existing.items():
            if name == joining.name:
                continue
            for b in range(rng.start, min(rng.end, L)):
                throughput[b] += _throughput(spec)
        start = lexicographic_window(throughput, m)
        return BlockRange(start, start + m)
    if algorithm != "cg-bprr":
        raise PlanningError(f"choose_range: unknown algorithm {algorithm!r} (petals or cg-bprr)")
    m = blocks_for_concurrency(joining.memory_bytes, model, concurrency)
    if m == 0:
        raise PlanningError(f"server {joining.name}: memory_bytes={joining.memory_bytes:.4g} cannot hold one block "
                            f"with caches for R={concurrency} sessions")

    def t_of(spec: ServerSpec, blocks: int) -> float:
        if perf is None or spec.name not in perf.profiles:
            return spec.profile.decode_s
        return amortised_block_time_s(perf, clients, spec.name, blocks)

    others = [(spec, rng) for name, (spec, rng) in existing.items() if name != joining.name]  # re-joins move
    placed = sorted(((t_of(spec, rng.length), spec, rng) for spec, rng in others), key=lambda x: x[0])
    t_new = t_of(joining, m)
    cov = _Coverage.empty(L, concurrency, max([t for t, _, _ in placed] + [t_new]) + 1.0)
    for t, spec, rng in placed:
        cov.add(rng, t, session_capacity(spec.memory_bytes, model, rng.length))
    start = cov.choose(m)
    return BlockRange(start, start + m)


def request_clients(clients: Sequence[ClientSpec], count: int) -> list[str]:
    """Which client issues each of `count` planned concurrent requests: round-robin in file order."""
    return [clients[r % len(clients)].name for r in range(count)]
