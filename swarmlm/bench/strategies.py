"""How the client drives a workload through the swarm: sequential, pipelined, microbatched.

All three are a "conveyor belt" (as in the scaling study): jobs wait in a queue, W worker threads take them one
at a time, each job is one inference session through the whole chain. What differs is W and the size of a job:

  sequential    W = 1, a job = one request             one request in flight: a server works only when the
                                                       hidden states reach it, then idles for the rest of the step
  pipelined     W = K, a job = one request             K sessions in flight: while server 1 runs request a,
                                                       server 2 can run request b (default K = servers in the route)
  microbatched  batches of M x b requests, each split  the M micro-batches of a batch start back to back so they
                into M batched sessions of b rows      occupy different stages at once; the next batch starts when
                                                       the whole batch is done (default M = servers, b = 2)
  microbatched  M = "auto": MoLink's micro-batch extension. Each batch (servers x b requests) is split into the
   (auto)       number of micro-batches MoLink's rule chooses from the measured decode compute and transfer times
                (bench/microbatch.py), re-evaluated for every batch as the measurements change

The workers are threads of one client process; the LM head and embeddings release the GIL inside torch, and the
client's gRPC I/O runs on its own event-loop thread, so K sessions really overlap. Every job returns one
`RequestRecord` per request, with its tokens, clocks and the decomposition of its response time.
"""
from __future__ import annotations

import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

import torch

from swarmlm.bench.decomposition import Decomposition, decompose
from swarmlm.bench.workload import Request
from swarmlm.client.remote_cache import GenerationStats
from swarmlm.bench.microbatch import MicroBatchPlanner
from swarmlm.client.session import InferenceSession
from swarmlm.perf.speculation import MAX_DRAFT_TOKENS
from swarmlm.stats import percentile
from swarmlm.types import CacheOp, Span
from swarmlm.wire import compress

StrategyName = Literal["sequential", "pipelined", "microbatched"]
STRATEGIES: tuple[StrategyName, ...] = ("sequential", "pipelined", "microbatched")


@dataclass(frozen=True)
class StrategyConfig:
    name: StrategyName
    in_flight: int | None = None  # pipelined: K sessions at once; None = number of servers in the route
    # microbatched: M micro-batches per batch; None = number of servers in the route; "auto" = MoLink's rule
    micro_batches: int | Literal["auto"] | None = None
    micro_batch_size: int = 2  # microbatched: requests (rows) per micro-batch, i.e. per batched session
    head_last_only: bool = True  # LM head on the last position only (what generate() does); False = on every
    #                              prompt position too, as the client did before (to measure what that costs)
    ignore_eos: bool = False  # True: always generate max_new_tokens (fixed work per request)
    # generate(speculative=...): "off", "auto" (draft length from the measured acceptance and route cost) or a fixed
    # draft length (text); batched sessions speculate per row (client/decoding/decoder.py)
    speculative: str = "off"

    def __post_init__(self) -> None:
        if self.name not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.name!r}; known: {', '.join(STRATEGIES)}")
        for what in ("in_flight", "micro_batches"):
            value = getattr(self, what)
            if value == "auto" and what == "micro_batches":
                continue
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{what} must be an integer >= 1{' or auto' if what == 'micro_batches' else ''},"
                                 f" got {value!r}")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.name != "pipelined" and self.in_flight is not None:
            raise ValueError(f"in_flight={self.in_flight} applies to 'pipelined' only, not {self.name!r}")

    def workers(self, route_servers: int) -> int:
        """Jobs in flight at once."""
        if self.name == "sequential":
            return 1
        if self.name == "pipelined":
            return self.in_flight or route_servers
        if self.micro_batches == "auto":  # requests in flight as with M = servers; their split is chosen
            return route_servers
        return self.micro_batches or route_servers

    @property
    def auto(self) -> bool:
        return self.name == "microbatched" and self.micro_batches == "auto"

    def label(self, route_servers: int) -> str:
        if self.name == "pipelined":
            return f"pipelined(K={self.workers(route_servers)})"
        if self.auto:
            return f"microbatched(M=auto,n={route_servers * self.micro_batch_size})"
        if self.name == "microbatched":
            return f"microbatched(M={self.workers(route_servers)},b={self.micro_batch_size})"
        return self.name


@dataclass(frozen=True)
class RequestRecord:
    request_id: int
    input_tokens: int
    generated_tokens: int
    tokens: tuple[int, ...]  # the new tokens (up to and including eos)
    arrival_s: float  # from the start of the run: when it could start (closed loop: when a worker took it)
    start_s: float  # when a worker took it
    end_s: float
    ttft_s: float  # arrival -> first new token chosen
    response_s: float  # arrival -> session closed
    batch_size: int  # rows in its session (1 unless microbatched)
    payload_sent_bytes: int  # hidden states + masks this request sent to servers (its share of its session)
    payload_received_bytes: int
    decomposition: Decomposition
    route: tuple[Span, ...] = ()  # the servers and blocks its session ended on
    error: str | None = None
    passes: int = 0  # steps through the route, the prompt's included (its session's, shared by its rows)
    round_trips: int = 0  # client round trips: a relayed step makes one per hop, a pushed step one along the chain
    drafted: int = 0  # speculation: draft tokens sent, and of them accepted
    accepted: int = 0

    @property
    def per_token_s(self) -> float:
        """Decode time per token after the first (the study's per-token time); the response time if only one."""
        if self.generated_tokens > 1:
            return (self.response_s - self.ttft_s) / (self.generated_tokens - 1)
        return self.response_s

    def to_dict(self) -> dict:
        return {
            "request_id": self.request_id, "input_tokens": self.input_tokens,
            "generated_tokens": self.generated_tokens, "tokens": list(self.tokens), "arrival_s": self.arrival_s,
            "start_s": self.start_s, "end_s": self.end_s, "ttft_s": self.ttft_s, "response_s": self.response_s,
            "per_token_s": self.per_token_s, "batch_size": self.batch_size,
            "payload_sent_bytes": self.payload_sent_bytes, "payload_received_bytes": self.payload_received_bytes,
            "decomposition_s": self.decomposition.to_dict(), "route": [s.describe() for s in self.route], "error": self.error,
            "passes": self.passes, "round_trips": self.round_trips, "drafted": self.drafted, "accepted": self.accepted,
        }


class TimedSession(InferenceSession):
    """An inference session that also clocks each step() as its caller sees it (the I/O-loop hand-off included)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.call_s: list[float] = []

    def step(self, hidden: torch.Tensor, mask: torch.Tensor | None = None, op: CacheOp | None = None,
             token_ids: torch.Tensor | None = None) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            return super().step(hidden, mask, op, token_ids)  # op: a cache edit sent with the step (if any)
        finally:
            self.call_s.append(time.perf_counter() - t0)


# ---- one job: one session for one or more requests ------------------------------------------------------

def _batch(requests: Sequence[Request], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and mask [B, L]: decoder-only generation pads on the left."""
    length = max(len(r.input_ids) for r in requests)
    ids = torch.full((len(requests), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(requests), length), dtype=torch.long)
    for row, r in enumerate(requests):
        ids[row, length - len(r.input_ids):] = torch.tensor(r.input_ids, dtype=torch.long)
        mask[row, length - len(r.input_ids):] = 1
    return ids, mask


def _payload_bytes(model, steps, batch: int, hidden_size: int) -> tuple[int, int]:
    """Hidden states and masks (int64) on the wire, both ways, summed over hops: the tensors' bytes in the format
    each hop's link carries them (wire/compress.py: the client's setting, or auto's choice for that link and size)."""
    channels, records = model.remote.channels, model.remote.view.records
    sent = received = 0
    for step in steps:
        for hop in step.hops:
            values = hop.n_tokens * batch * hidden_size
            record = records.get(hop.server_id)
            wire = channels.wire_dtype_for(record.address, 4 * values) if record is not None else channels.wire_dtype
            nbytes = math.ceil(values * compress.bytes_per_value(wire if wire != "auto" else "float32"))
            sent += nbytes + hop.n_tokens * batch * 8
            received += nbytes
    return sent, received


def run_job(model, requests: Sequence[Request], cfg: StrategyConfig, t_run0: float,
            on_steps: Callable[[int, list], None] | None = None) -> list[RequestRecord]:
    """One inference session for `requests` (one row each); records clocked from the run's start t_run0.
    `on_steps(rows, steps)` sees the session's step records (the micro-batch planner learns from them)."""
    arrival = max(r.arrival_s for r in requests) if requests[0].arrival_s is not None else None
    t_start = time.perf_counter()
    t_from = t_run0 + arrival if arrival is not None else t_start  # response time counts from here
    client_wait = max(t_start - t_from, 0.0)
    pad_id = model.pad_token_id if model.pad_token_id is not None else 0
    ids, mask = _batch(requests, pad_id)
    batch, length = ids.shape
    max_new = max(r.max_new_tokens for r in requests)
    eos = () if cfg.ignore_eos else model.eos_token_id
    room = 0 if cfg.speculative == "off" else 2 * MAX_DRAFT_TOKENS + 1  # a pass's drafts, before their rollback
    session = TimedSession(model.remote, batch, length + max_new + room, length, max_new)
    try:
        session.open()
        t_gen = time.perf_counter()
        stats = GenerationStats()
        # greedy, transformers' generate() in our session; the LM head on the last position (logits_to_keep=1, what
        # generate() asks for) or on every prompt position too (0), to measure what that costs
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, session=session,
                             stats=stats, logits_to_keep=1 if cfg.head_last_only else 0,
                             speculative=cfg.speculative, **({"eos_token_id": None} if cfg.ignore_eos else {}))
        t_closing = time.perf_counter()
    except Exception as exc:  # one failed request is a result, not the end of the benchmark
        _close_quietly(session)  # a broken session may not close cleanly either; the request failed already
        return [_failed(r, t_start - t_run0, time.perf_counter() - t_run0, f"{type(exc).__name__}: {exc}")
                for r in requests]
    close_error = _close_quietly(session)
    t_end = time.perf_counter()
    if on_steps is not None:
        on_steps(batch, session.steps)
    parts = decompose(t_end - t_from, session.open_s, t_end - t_closing, client_wait, stats, session.call_s,
                      session.steps)
    sent, received = _payload_bytes(model, session.steps, batch, int(model.config.hidden_size))
    ttft = t_gen + stats.ttft_s - t_from
    spec = stats.speculation or {}
    spec_rows = spec.get("rows") or [spec] * batch  # a batch's drafts per row; one row's are the session's
    round_trips = sum(1 if step.pushed else len({h.server_id for h in step.hops}) for step in session.steps)
    records = []
    for row, r in enumerate(requests):
        new = out[row, length:length + r.max_new_tokens].tolist()
        for i, tok in enumerate(new):  # a row ends at its eos; after it the batch pads
            if tok in eos:
                new = new[:i + 1]
                break
        records.append(RequestRecord(
            request_id=r.request_id, input_tokens=len(r.input_ids), generated_tokens=len(new), tokens=tuple(new),
            arrival_s=t_from - t_run0, start_s=t_start - t_run0, end_s=t_end - t_run0, ttft_s=ttft,
            response_s=t_end - t_from, batch_size=batch, payload_sent_bytes=sent // batch,
            payload_received_bytes=received // batch, decomposition=parts, route=stats.route,
            error=close_error, passes=len(session.steps), round_trips=round_trips,
            drafted=spec_rows[row].get("drafted", 0), accepted=spec_rows[row].get("accepted", 0),
        ))
    return records


def _close_quietly(session: InferenceSession) -> str | None:
    """Close the session; a failure to close is reported, not raised (the tokens are already there)."""
    try:
        session.close()
        return None
    except Exception as exc:
        return f"close failed: {type(exc).__name__}: {exc}"


def _failed(r: Request, start_s: float, end_s: float, error: str) -> RequestRecord:
    nothing = Decomposition(0.0, 0.0, 0.0, 0.0, 0.0)
    return RequestRecord(r.request_id, len(r.input_ids), 0, (), start_s, start_s, end_s, 0.0, end_s - start_s, 1,
                         0, 0, nothing, error=error)


# ---- the conveyor belt -----------------------------------------------------------------------------------

OnRecords = Callable[[list[RequestRecord]], None]


def _drain(model, jobs: Sequence[Sequence[Request]], workers: int, cfg: StrategyConfig, t_run0: float,
           on_records: OnRecords | None, on_steps: Callable[[int, list], None] | None = None) -> list[RequestRecord]:
    """Run jobs with `workers` threads, each taking the next job when free; open-loop jobs wait for arrival."""
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for job in jobs:
        todo.put(job)
    results: list[RequestRecord] = []
    lock = threading.Lock()
    crashed: list[BaseException] = []

    def worker() -> None:
        while True:
            try:
                job = todo.get_nowait()
            except queue.Empty:
                return
            if job[0].arrival_s is not None:  # the job cannot start before its last request has arrived
                wait = t_run0 + max(r.arrival_s for r in job) - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
            try:
                records = run_job(model, job, cfg, t_run0, on_steps)
            except BaseException as exc:  # a bug, not a failed request: stop and re-raise in the caller
                crashed.append(exc)
                return
            with lock:
                results.extend(records)
            if on_records is not None:
                on_records(records)

    threads = [threading.Thread(target=worker, name=f"bench-worker-{i}", daemon=True)
               for i in range(min(workers, len(jobs)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if crashed:
        raise crashed[0]
    return results


def micro_batch_planner(model) -> MicroBatchPlanner:
    """MoLink's rule for this client: its hidden size and dtype, the slowest span's announced decode profile, the
    slowest measured link."""
    remote = model.remote
    route = remote.route(0, remote.num_blocks, 16, 16)
    profile = max((remote.view.records[s.server_id].decode_s * s.length
                   for s in route.spans if s.server_id in remote.view.records), default=0.0)
    bytes_per_row = int(model.config.hidden_size) * torch.empty((), dtype=model.dtype).element_size()
    addresses = [s.address for s in route.spans]
    return MicroBatchPlanner(bytes_per_row, profile,
                             lambda: min(remote.channels.bandwidth(a).bandwidth_bps for a in addresses))


def split_evenly(items: Sequence, parts: int) -> list[list]:
    """Exactly min(parts, len(items)) consecutive slices whose sizes differ by at most one (8 in 7 -> 2,1,1,1,1,1,1;
    a fixed rows-per-slice of ceil(8 / 7) = 2 would give 4 slices, not the 7 the rule asked for)."""
    parts = max(1, min(parts, len(items)))
    q, r = divmod(len(items), parts)
    bounds = [i * q + min(i, r) for i in range(parts + 1)]
    return [list(items[a:b]) for a, b in zip(bounds, bounds[1:])]


def run_strategy(model, requests: Sequence[Request], cfg: StrategyConfig, route_servers: int,
                 on_records: OnRecords | None = None, decisions: list | None = None) -> list[RequestRecord]:
    """Run the whole workload; returns one record per request, in request order. With M = auto, `decisions`
    receives what the micro-batch rule chose for each batch and from which times."""
    if not requests:
        return []
    workers = cfg.workers(route_servers)
    t_run0 = time.perf_counter()
    if cfg.name in ("sequential", "pipelined"):
        records = _drain(model, [[r] for r in requests], workers, cfg, t_run0, on_records)
    else:
        size = workers * cfg.micro_batch_size
        planner = micro_batch_planner(model) if cfg.auto else None
        records = []
        for i in range(0, len(requests), size):
            group = requests[i:i + size]
            if planner is None:
                micro = [group[j:j + cfg.micro_batch_size] for j in range(0, len(group), cfg.micro_batch_size)]
            else:  # MoLink: the number of micro-batches from the latest measurements
                micro = split_evenly(group, planner.choose(len(group), fallback=route_servers))
            records += _drain(model, micro, len(micro), cfg, t_run0, on_records,  # the batch ends before the next
                              planner.observe if planner else None)
        if planner is not None and decisions is not None:
            decisions += planner.decisions
    records.sort(key=lambda rec: rec.request_id)
    return records


@dataclass(frozen=True)
class RunTotals:
    """What a run delivered, over its makespan (first start to last end)."""

    requests: int
    failed: int
    generated_tokens: int
    makespan_s: float
    throughput_tokens_per_s: float
    mean_response_s: float
    mean_ttft_s: float
    mean_per_token_s: float
    efficiency_s_per_token: float  # token-normalised: mean over requests of response time / generated tokens
    # percentiles over requests: time to first token, and time per output token after the first (TPOT)
    p50_ttft_s: float = 0.0
    p90_ttft_s: float = 0.0
    p50_per_token_s: float = 0.0
    p90_per_token_s: float = 0.0
    extra: dict = field(default_factory=dict, hash=False, compare=False)


def totals(records: Sequence[RequestRecord]) -> RunTotals:
    ok = [r for r in records if r.error is None]
    if not ok:
        return RunTotals(len(records), len(records), 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    makespan = max(r.end_s for r in ok) - min(r.arrival_s for r in ok)
    generated = sum(r.generated_tokens for r in ok)
    n = len(ok)
    return RunTotals(
        requests=len(records), failed=len(records) - n, generated_tokens=generated, makespan_s=makespan,
        throughput_tokens_per_s=generated / makespan if makespan > 0 else 0.0,
        mean_response_s=sum(r.response_s for r in ok) / n, mean_ttft_s=sum(r.ttft_s for r in ok) / n,
        mean_per_token_s=sum(r.per_token_s for r in ok) / n,
        efficiency_s_per_token=sum(r.response_s / max(r.generated_tokens, 1) for r in ok) / n,
        p50_ttft_s=percentile([r.ttft_s for r in ok], 50), p90_ttft_s=percentile([r.ttft_s for r in ok], 90),
        p50_per_token_s=percentile([r.per_token_s for r in ok], 50),
        p90_per_token_s=percentile([r.per_token_s for r in ok], 90),
    )
