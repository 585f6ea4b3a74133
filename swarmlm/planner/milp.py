"""Exact joint block placement + request routing (the paper's MILP), solved with HiGHS (highspy).

Variables (n servers, R planned requests, L blocks; half-open ranges):
    a_j, e_j   integers in [0, L]: server j holds [a_j, e_j)  (e_j = a_j: j holds nothing)
    f[r,i,j]   binary: request r takes hop i -> j; i in {src} + servers, j in servers + {dst}
    k[r,i,j]   >= 0: blocks request r runs on j after i, = f * (e_j - e_i) (McCormick with big-M L)
Constraints:
    one unit of flow src -> dst per request; hop i -> j only if a_j <= e_i <= e_j - 1; last hop only from e_i = L;
    memory  s_m (e_j - a_j) + s_c sum_{r,i} k[r,i,j] <= M_j   (caches for the blocks each session runs there);
    cut     sum_{i,j} k[r,i,j] = L for every request.
Objective: total request time  sum_r sum_hops f (tI_cj + (l_out-1) t_cj) + k (tauI_j(l_in) + (l_out-1) tau_j).
Requests are assigned to clients round-robin (`request_clients`), exactly as the plan's prediction does.
CG-BPRR's solution is the warm start, so under a time limit the result is never worse than CG-BPRR's.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import time

import highspy
import numpy as np
from scipy.sparse import lil_matrix

from swarmlm.errors import PlanningError
from swarmlm.planner.placement import PlacementOptions, PlacementResult, place_cg_bprr, request_clients
from swarmlm.planner.hop_graph import HopGraph, bprr_hop_cost
from swarmlm.planner.topology import Topology
from swarmlm.types import BlockRange, Span

SRC, DST = -1, -2  # pseudo-nodes of every request's flow


class _Vars:
    """Column indices of the MILP variables."""

    def __init__(self, n: int, requests: int) -> None:
        self.n, self.requests = n, requests
        self.a = list(range(0, n))
        self.e = list(range(n, 2 * n))
        self.arcs = [(i, j) for i in [SRC, *range(n)] for j in [*range(n), DST] if i != j and (i, j) != (SRC, DST)]
        col = 2 * n
        self.f: dict[tuple[int, int, int], int] = {}
        self.k: dict[tuple[int, int, int], int] = {}
        for r in range(requests):
            for i, j in self.arcs:
                self.f[r, i, j] = col
                col += 1
                if j != DST:
                    self.k[r, i, j] = col
                    col += 1
        self.count = col


def place_milp(topology: Topology, concurrency: int, options: PlacementOptions = PlacementOptions()) -> PlacementResult:
    started = time.perf_counter()
    model, perf, wl = topology.model, topology.perf, topology.workload
    servers = list(topology.servers)
    n, L, R = len(servers), model.num_blocks, concurrency
    clients = request_clients(topology.clients, R)
    v = _Vars(n, R)
    rows: list[tuple[dict[int, float], float, float]] = []  # (coefficients, lower, upper)

    def row(coefs: dict[int, float], lo: float, hi: float) -> None:
        rows.append((coefs, lo, hi))

    for j in range(n):
        row({v.e[j]: 1, v.a[j]: -1}, 0, np.inf)  # a_j <= e_j
        # memory, in units of block_bytes to keep the matrix well scaled
        mem = {v.e[j]: 1.0, v.a[j]: -1.0}
        ratio = model.cache_bytes_per_session_block / model.block_bytes
        for r in range(R):
            for i, jj in v.arcs:
                if jj == j:
                    mem[v.k[r, i, j]] = ratio
        row(mem, -np.inf, servers[j].memory_bytes / model.block_bytes)
    for r in range(R):
        row({v.f[r, SRC, j]: 1 for j in range(n)}, 1, 1)
        row({v.f[r, i, DST]: 1 for i in range(n)}, 1, 1)
        # valid cut (k is exact at integral points): every request runs all L blocks, whatever its hops.
        # It lifts the LP bound from ~0 to L x the cheapest per-block cost, closing most of the gap.
        row({v.k[r, i, j]: 1.0 for i, j in v.arcs if j != DST}, L, L)
        for s in range(n):  # conservation at every server
            coefs = {v.f[r, i, s]: 1.0 for i, j in v.arcs if j == s}
            coefs.update({v.f[r, s, j]: -1.0 for i, j in v.arcs if i == s})
            row(coefs, 0, 0)
        for i, j in v.arcs:
            f = v.f[r, i, j]
            if j == DST:
                row({v.e[i]: -1, f: L}, -np.inf, 0)  # last hop only from a server ending at L
                continue
            k = v.k[r, i, j]
            ei = {v.e[i]: -1.0} if i != SRC else {}  # e_src = 0
            row({v.a[j]: 1, **ei, f: L}, -np.inf, L)  # a_j <= e_i
            row({**{key: -c for key, c in ei.items()}, v.e[j]: -1, f: L + 1}, -np.inf, L)  # e_i + 1 <= e_j
            row({v.e[j]: 1, **ei, k: -1, f: L}, -np.inf, L)  # k >= e_j - e_i - L (1 - f)
            row({v.e[j]: -1, **{key: -c for key, c in ei.items()}, k: 1, f: L}, -np.inf, L)  # k <= e_j - e_i + L(1-f)
            row({k: 1, f: -L}, -np.inf, 0)  # k <= L f

    cost = np.zeros(v.count)
    for r in range(R):
        for i, j in v.arcs:
            if j == DST:
                continue
            name = servers[j].name
            fixed, per_block = perf.hop_cost_terms(clients[r], name, wl.input_tokens, wl.output_tokens)
            cost[v.f[r, i, j]] = fixed
            cost[v.k[r, i, j]] = per_block

    A = lil_matrix((len(rows), v.count))
    lo, hi = np.empty(len(rows)), np.empty(len(rows))
    for idx, (coefs, low, high) in enumerate(rows):
        for col, c in coefs.items():
            A[idx, col] = c
        lo[idx], hi[idx] = low, high
    integer = np.ones(v.count, dtype=bool)
    upper = np.full(v.count, float(L))
    for col in v.f.values():
        upper[col] = 1.0
    for col in v.k.values():
        integer[col] = False  # k is integral at any vertex with integral a, e, f; keep it continuous
    start = _warm_start(topology, R, v, servers, clients)
    x, objective, gap, status = _solve(cost, A.tocsc(), lo, hi, upper, integer, options.time_limit_s, start)
    if x is None:
        raise PlanningError(f"milp: no feasible placement found within {options.time_limit_s:g} s ({status}); "
                            f"the model may not fit with R={R} sessions")
    x = np.round(x).astype(int)
    ranges = {servers[j].name: BlockRange(int(x[v.a[j]]), int(x[v.e[j]]))
              for j in range(n) if x[v.e[j]] > x[v.a[j]]}
    routes = tuple((clients[r], _extract_route(v, x, r, servers, ranges)) for r in range(R))
    notes = (f"R={R}", f"HiGHS: {status}", "warm start: cg-bprr" if start is not None else "no warm start")
    return PlacementResult(ranges, solve_s=time.perf_counter() - started, gap=gap, objective_s=objective,
                           routes=routes, notes=notes)


def _warm_start(topology: Topology, R: int, v: _Vars, servers, clients: list[str]) -> np.ndarray | None:
    """CG-BPRR's placement with shortest-path routes as a feasible incumbent: HiGHS then never returns worse
    than CG-BPRR and reports a gap even when the time limit stops it. None if CG-BPRR cannot place R."""
    try:
        cg = place_cg_bprr(topology, R)
    except PlanningError:
        return None
    wl, perf = topology.workload, topology.perf
    index = {s.name: j for j, s in enumerate(servers)}
    x = np.zeros(v.count)
    for name, rng in cg.ranges.items():
        x[v.a[index[name]]], x[v.e[index[name]]] = rng.start, rng.end
    graph = HopGraph(cg.ranges, topology.model.num_blocks)
    for r, client in enumerate(clients):
        prev = SRC
        for span in graph.shortest(bprr_hop_cost(perf, client, wl.input_tokens, wl.output_tokens)):
            j = index[span.server_id]
            x[v.f[r, prev, j]], x[v.k[r, prev, j]] = 1.0, span.length
            prev = j
        x[v.f[r, prev, DST]] = 1.0
    return x


@contextlib.contextmanager
def _quiet_stdout():
    """Point file descriptor 1 at /dev/null (C++ writes bypass sys.stdout)."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _solve(cost: np.ndarray, A, lo: np.ndarray, hi: np.ndarray, upper: np.ndarray, integer: np.ndarray,
           time_limit_s: float, start: np.ndarray | None) -> tuple[np.ndarray | None, float, float | None, str]:
    """min cost.x s.t. lo <= A x <= hi, 0 <= x <= upper, x[integer] integral; HiGHS with a time limit."""
    with _quiet_stdout():  # HiGHS prints a banner from C++ on construction; keep `plan --json` clean
        h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("threads", 1)  # deterministic, and polite on a shared machine
    h.setOptionValue("mip_rel_gap", 1e-7)  # HiGHS stops at 1e-4 by default; "optimal" here must mean optimal
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = A.shape[1], A.shape[0]
    lp.col_cost_ = cost
    lp.col_lower_, lp.col_upper_ = np.zeros(A.shape[1]), upper
    lp.row_lower_ = np.where(np.isinf(lo), -highspy.kHighsInf, lo)
    lp.row_upper_ = np.where(np.isinf(hi), highspy.kHighsInf, hi)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = A.indptr, A.indices, A.data
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = A.shape[1], A.shape[0]
    lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous for i in integer]
    h.passModel(lp)
    if start is not None:
        sol = highspy.HighsSolution()
        sol.col_value = list(start)
        h.setSolution(sol)
    h.run()
    status = h.modelStatusToString(h.getModelStatus())
    info = h.getInfo()
    if info.primal_solution_status != 2:  # 2 = feasible
        return None, math.inf, None, status
    return np.array(h.getSolution().col_value), float(info.objective_function_value), float(info.mip_gap), status


def _extract_route(v: _Vars, x: np.ndarray, r: int, servers, ranges: dict[str, BlockRange]) -> tuple[Span, ...]:
    spans: list[Span] = []
    node, pos = SRC, 0
    while node != DST:
        nxt = next(j for (i, j) in v.arcs if i == node and x[v.f[r, i, j]] == 1)
        if nxt != DST:
            name = servers[nxt].name
            spans.append(Span(name, pos, ranges[name].end))
            pos = ranges[name].end
        node = nxt
    return tuple(spans)
