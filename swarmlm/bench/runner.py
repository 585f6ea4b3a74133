"""The scaling study, built in: for each N a fresh swarm (even contiguous split), every strategy, measured.

    for N in servers:                        fresh DHT + N servers (or N emulated hosts with --network)
        client = DistributedModelForCausalLM  one warm-up request (routing, RTT probes, first-touch costs)
        telemetry sampler on                  every process, once a second
        for strategy in strategies:           the same requests, the same tokens
            records = run_strategy(...)       per request: clocks, tokens, decomposition
            run = summarise(records, window)  per run: throughput, efficiency, telemetry, decomposition
    speed-ups against N = 1 of the same strategy

With a network profile the servers run on netem testbed hosts (network namespaces when we have the rights) and
the client dials each server through the testbed's `expose` address. The relay picks its own port there, so a
server cannot announce it (`--announce-host` sets only the host): the client gets the exposed addresses as a
fixed server list (ClientConfig.servers) instead of reading them from a DHT.
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import psutil

from swarmlm.bench.decomposition import mean_decomposition
from swarmlm.bench.strategies import RequestRecord, StrategyConfig, run_job, run_strategy, totals
from swarmlm.bench.telemetry import SAMPLE_COLUMNS, Sample, TelemetrySampler, Tracked, summarize
from swarmlm.bench.workload import Request
from swarmlm.swarm.local import LocalSwarm, even_split

LOOPBACK = "loopback"
_BASE_PORT = 40100  # servers on emulated hosts listen on fixed ports (each host has its own address)


@dataclass(frozen=True)
class BenchConfig:
    model_dir: str
    servers: tuple[int, ...]  # swarm sizes N to run, each with an even contiguous split
    strategies: tuple[StrategyConfig, ...]
    network: str = LOOPBACK  # "loopback" | "lan" | "wan" | a topology file (per-cluster links)
    netem_mode: str = "auto"  # testbed mode with a network: "auto" | "namespaces" | "relay-only"
    server_threads: int = 1  # torch threads per server process
    client_threads: int = 1  # torch threads for the client's embeddings and LM head
    warmup_requests: int = 1  # per swarm, not recorded
    telemetry_interval_s: float = 1.0
    log_dir: str | None = None  # server logs (default: a temporary directory per swarm)
    push: str = "auto"  # server-to-server push (ClientConfig.push): "auto" | "on" | "off"
    prefill_chunk_tokens: int | None = None  # ClientConfig.prefill_chunk_tokens: None = auto, 0 = off
    quant: str = "auto"  # servers' blocks and the client's head + embeddings (QUANT_NAMES, model/quant.py)
    wire_dtype: str = "auto"  # ClientConfig.wire_dtype: hidden states on the wire (wire/compress.py)
    dtype: str = "auto"  # weights and compute on servers and client (config.DTYPE_NAMES)

    def __post_init__(self) -> None:
        if not self.servers or any(n < 1 for n in self.servers) or len(set(self.servers)) != len(self.servers):
            raise ValueError(f"servers must be distinct positive counts, got {self.servers}")
        if not self.strategies:
            raise ValueError("give at least one strategy")
        if self.server_threads < 1 or self.client_threads < 1 or self.warmup_requests < 0:
            raise ValueError("threads must be >= 1 and warmup_requests >= 0")
        if self.netem_mode not in ("auto", "namespaces", "relay-only"):
            raise ValueError(f"netem_mode must be auto, namespaces or relay-only, got {self.netem_mode!r}")


@dataclass
class Swarm:
    """What one N needs: how the client reaches the servers, and which processes to watch."""

    initial_peers: list[str] = field(default_factory=list)
    server_addresses: list[str] = field(default_factory=list)  # direct list (netem) instead of a DHT
    tracked: list[Tracked] = field(default_factory=list)
    network_info: dict = field(default_factory=dict)
    testbed: object = None  # the netem Testbed when there is one (to start probes on its hosts)


@dataclass
class BenchResult:
    config: BenchConfig
    runs: list[dict] = field(default_factory=list)
    telemetry: list[dict] = field(default_factory=list)  # per N: {"servers": N, "rows": [...]}


# ---- swarms ----------------------------------------------------------------------------------------------

def link_matrix(network: str, n_hosts: int):
    """A profile name or a planner topology file -> the netem LinkMatrix for n hosts (None on plain loopback).

    netem's `network_for` reads the file: its first n servers are the hosts, its first client is the client.
    """
    if network == LOOPBACK:
        return None
    from swarmlm.bench.netem import network_for

    return network_for(network, n_hosts)


def _relay_pids() -> list[int]:
    """The netem relay is our child process; it is tracked on its own so its CPU is not the client's."""
    return [c.pid for c in psutil.Process().children(recursive=True)
            if "swarmlm.bench.netem.delay_relay" in " ".join(_cmdline(c))]


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


@contextlib.contextmanager
def start_swarm(cfg: BenchConfig, n: int, num_blocks: int) -> Iterator[Swarm]:
    """A fresh swarm of n servers over an even split; everything started here is stopped on exit."""
    log_dir = Path(cfg.log_dir) / f"n{n}" if cfg.log_dir else None
    ranges = even_split(num_blocks, n)
    client = Tracked("client", os.getpid())
    if cfg.network == LOOPBACK:
        with LocalSwarm(cfg.model_dir, threads=cfg.server_threads, log_dir=log_dir,
                        server_args=["--quant", cfg.quant, "--dtype", cfg.dtype, "--publish-counters"]) as local:
            local.start(ranges)
            tracked = [client] + [Tracked(f"server{i}", s.proc.pid, address=s.address)
                                  for i, s in enumerate(local.servers)]
            tracked.append(Tracked("dht", local.dht_proc.pid))
            yield Swarm(initial_peers=list(local.initial_peers), tracked=tracked, network_info={"mode": LOOPBACK})
        return
    from swarmlm.bench.netem import Testbed

    with Testbed(n, link_matrix(cfg.network, n), mode=cfg.netem_mode) as tb:
        with LocalSwarm(cfg.model_dir, threads=cfg.server_threads, log_dir=log_dir, with_dht=False,
                        server_args=["--quant", cfg.quant, "--dtype", cfg.dtype, "--publish-counters"]) as local:
            started = [local.start_server(r, extra=["--port", str(_BASE_PORT + i)], wait=False,
                                          prefix=tb.exec_prefix(i), host=tb.host_ip(i))
                       for i, r in enumerate(ranges)]
            local.wait_ready(started)
            addresses = [tb.expose(i, _BASE_PORT + i) for i in range(n)]
            tracked = [client] + [Tracked(f"server{i}", s.proc.pid, tuple(tb.exec_prefix(i)), addresses[i])
                                  for i, s in enumerate(started)]
            tracked += [Tracked("relay" if k == 0 else f"relay{k}", pid) for k, pid in enumerate(_relay_pids())]
            info = {"mode": tb.mode, "fallback_reason": tb.fallback_reason, "path_overhead_s": tb.path_overhead_s,
                    "client_link": _link_dict(tb.network.link(-1, 0)), **_check_link(tb)}
            yield Swarm(server_addresses=addresses, tracked=tracked, network_info=info, testbed=tb)


def _check_link(tb) -> dict:
    """What the client's link to host 0 really does (netem's own probe: echo RTT, bulk goodput both ways)."""
    from swarmlm.bench.netem.accuracy import check_testbed

    c = check_testbed(tb, host=0)
    return {"measured_rtt_s": c.rtt.median_s, "measured_up_bps": c.up.bits_per_s if c.up else None,
            "measured_down_bps": c.down.bits_per_s if c.down else None}


def _link_dict(link) -> dict:
    return {"rtt_s": link.rtt_s, "rate_bps": link.rate_bps, "jitter_s": link.jitter_s, "loss": link.loss}


# ---- one N -----------------------------------------------------------------------------------------------

Progress = Callable[[str, int], None]  # (description, requests just finished)


def run_swarm_size(cfg: BenchConfig, n: int, requests: Sequence[Request], num_blocks: int,
                   progress: Progress | None = None) -> tuple[list[dict], dict]:
    from swarmlm.client.model import DistributedModelForCausalLM

    runs: list[dict] = []
    with start_swarm(cfg, n, num_blocks) as swarm:
        model = DistributedModelForCausalLM.from_pretrained(
            cfg.model_dir, initial_peers=swarm.initial_peers, servers=swarm.server_addresses,
            threads=cfg.client_threads, push=cfg.push, prefill_chunk_tokens=cfg.prefill_chunk_tokens,
            quant=cfg.quant, wire_dtype=cfg.wire_dtype, dtype=cfg.dtype)
        try:
            warm = StrategyConfig("sequential", ignore_eos=cfg.strategies[0].ignore_eos)
            for r in list(requests)[:cfg.warmup_requests]:
                run_job(model, [r], warm, time.perf_counter())
            route = model.remote.route(0, num_blocks, 16, 16)
            route_servers = len(route.spans)
            with TelemetrySampler(swarm.tracked, cfg.telemetry_interval_s) as sampler:
                for strategy in cfg.strategies:
                    label = strategy.label(route_servers)
                    if progress:
                        progress(f"N={n} {label}", 0)
                    load = os.getloadavg()[0]
                    t_from = sampler.now()
                    decisions: list[dict] = []
                    records = run_strategy(model, requests, strategy, route_servers,
                                           on_records=(lambda recs, lb=label: progress(f"N={n} {lb}", len(recs)))
                                           if progress else None, decisions=decisions)
                    t_to = sampler.now()
                    sampler.wait_past(t_to, timeout_s=4 * cfg.telemetry_interval_s + 5)  # the window's last sample
                    runs.append(summarise_run(n, strategy, label, records, sampler.samples, t_from, t_to,
                                              cfg.network, swarm.network_info, route, load))
                    runs[-1]["push"] = cfg.push
                    runs[-1]["pushed"] = model.remote.push(list(route.spans))  # what "auto" chose on this route
                    runs[-1]["prefill_chunk_tokens"] = cfg.prefill_chunk_tokens
                    if strategy.auto:
                        runs[-1]["micro_batch_decisions"] = decisions
            telemetry = {"servers": n, "columns": SAMPLE_COLUMNS, "rows": [s.to_row() for s in sampler.samples],
                         "windows": [{"strategy": r["strategy"], "t_from": r["window_s"][0],
                                      "t_to": r["window_s"][1]} for r in runs]}
        finally:
            model.close()
    return runs, telemetry


def summarise_run(n: int, strategy: StrategyConfig, label: str, records: list[RequestRecord], samples: list[Sample],
                  t_from: float, t_to: float, network: str, network_info: dict, route, load_1min: float) -> dict:
    ok = [r for r in records if r.error is None]
    tot = totals(records)
    dec = mean_decomposition([r.decomposition for r in ok])
    tel = summarize(samples, t_from, t_to)
    procs = {k: v for k, v in tel.items() if k != "system"}
    return {
        "servers": n, "strategy": "microbatched-auto" if strategy.auto else strategy.name, "strategy_label": label,
        "network": network,
        "network_info": network_info, "in_flight": strategy.workers(len(route.spans)),
        "micro_batch_size": strategy.micro_batch_size if strategy.name == "microbatched" and not strategy.auto else
        (max((r.batch_size for r in records), default=1) if strategy.auto else 1),
        "route": [f"{s.server_id[:16]}[{s.start}:{s.end})" for s in route.spans],
        "requests_count": tot.requests, "failed": tot.failed, "generated_tokens": tot.generated_tokens,
        "makespan_s": tot.makespan_s, "throughput_tokens_per_s": tot.throughput_tokens_per_s,
        "mean_response_s": tot.mean_response_s, "mean_ttft_s": tot.mean_ttft_s,
        "mean_per_token_s": tot.mean_per_token_s, "efficiency_s_per_token": tot.efficiency_s_per_token,
        "p50_ttft_s": tot.p50_ttft_s, "p90_ttft_s": tot.p90_ttft_s, "p50_per_token_s": tot.p50_per_token_s,
        "p90_per_token_s": tot.p90_per_token_s,
        "speedup_throughput": None, "speedup_response": None,  # filled once N = 1 is known
        "speculative": strategy.speculative, **trips_per_token(ok),
        "decomposition_s": dec.parts(), "decomposition_residual_s": dec.residual_s,
        "decomposition_measured_s": dec.measured_s, "decomposition_detail_s": dec.detail_s,
        "payload_bytes": sum(r.payload_sent_bytes + r.payload_received_bytes for r in ok),
        # every byte leaves one process: the sum of tx over the client, servers (and relay) is the traffic
        "network_tx_bytes": sum(v.tx_bytes for v in procs.values()),
        "telemetry": {k: vars(v) for k, v in tel.items()}, "window_s": [t_from, t_to],
        "load_avg_1min_at_start": load_1min,
        "requests": [r.to_dict() for r in records],
    }


def trips_per_token(records: list[RequestRecord]) -> dict:
    """Tokens per pass through the route, client round trips per token (a relayed step makes one per hop, a pushed
    one a single trip along the chain) and speculation's acceptance rate (drafts accepted / sent), over the run.
    A batched session's passes and trips are in each of its rows' records, as its tokens are counted per row."""
    n_tokens = sum(r.generated_tokens for r in records)
    passes = sum(r.passes for r in records)
    drafted = sum(r.drafted for r in records)  # each row's own drafts (a batch's rows draft on their own)
    accepted = sum(r.accepted for r in records)
    return {"tokens_per_pass": n_tokens / passes if passes else 0.0,
            "round_trips_per_token": sum(r.round_trips for r in records) / n_tokens if n_tokens else 0.0,
            "acceptance_rate": accepted / drafted if drafted else None, "drafted_tokens": drafted}


def add_speedups(runs: list[dict]) -> None:
    """Against N = 1 of the same strategy and network (when N = 1 was run)."""
    base = {(r["strategy"], r["network"]): r for r in runs if r["servers"] == 1}
    for r in runs:
        b = base.get((r["strategy"], r["network"]))
        if b is None:
            continue
        r["speedup_throughput"] = (r["throughput_tokens_per_s"] / b["throughput_tokens_per_s"]
                                   if b["throughput_tokens_per_s"] else None)
        r["speedup_response"] = b["mean_response_s"] / r["mean_response_s"] if r["mean_response_s"] else None


def run_bench(cfg: BenchConfig, requests: Sequence[Request], progress: Progress | None = None,
              on_swarm_done: Callable[[BenchResult], None] | None = None) -> BenchResult:
    """Every N in turn (a fresh swarm each); `on_swarm_done` sees the partial result after each N."""
    from swarmlm.model.checkpoint import load_config  # a directory or a hub id

    num_blocks = int(load_config(cfg.model_dir).num_hidden_layers)
    too_many = [n for n in cfg.servers if n > num_blocks]
    if too_many:
        raise ValueError(f"cannot split {num_blocks} blocks over {too_many} servers")
    result = BenchResult(cfg)
    for n in cfg.servers:
        runs, telemetry = run_swarm_size(cfg, n, requests, num_blocks, progress)
        result.runs += runs
        result.telemetry.append(telemetry)
        add_speedups(result.runs)
        if on_swarm_done:
            on_swarm_done(result)
    return result
