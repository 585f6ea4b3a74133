"""Once a second, for the client and every server: CPU %, RSS, TCP bytes sent/received, and RTT to each server.

CPU and RSS come from psutil over each process's tree (a server's p2pd daemons count as
the server's; a tracked process's own subtree is never counted twice), CPU in % of one core.

Network bytes: psutil has no per-process counters on Linux, so they are read from the kernel's per-socket TCP
counters (`ss -tinp`: tcpi_bytes_acked = payload sent and acknowledged, tcpi_bytes_received), summed over the
sockets each process tree owns. `ss` runs in each process's network namespace (the netem testbed puts servers in
their own). A socket's last seen value is kept after it closes, so totals only grow. These are TCP payload bytes
(gRPC frames + protobuf + tensors, DHT traffic too), without IP/TCP headers. On loopback every byte shows up twice,
once as the sender's tx and once as the receiver's rx, as it would on two machines.

RTT: the client's gRPC `Info` round trip to each server's address (through the emulated link when there is one),
on a channel of its own, so it measures the path and the server's event loop, not the queue of a busy stream.
A row named "system" carries the whole machine's CPU (all processes, ours or not) in the same units.
"""
from __future__ import annotations

import asyncio
import re
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import psutil

SYSTEM = "system"
_PID_RE = re.compile(r"pid=(\d+)")
_ACKED_RE = re.compile(r"bytes_acked:(\d+)")
_RECEIVED_RE = re.compile(r"bytes_received:(\d+)")


@dataclass(frozen=True)
class Tracked:
    name: str  # "client", "server0", ..., "dht", "relay"
    pid: int
    netns_prefix: tuple[str, ...] = ()  # command prefix that enters its network namespace (() = ours)
    address: str | None = None  # host:port to measure the RTT to (servers only)


@dataclass(frozen=True)
class Sample:
    t_s: float  # seconds since the sampler started
    name: str
    cpu_percent: float  # % of one core, process tree
    rss_bytes: int
    tx_bytes: int  # cumulative since the sampler started
    rx_bytes: int
    rtt_s: float | None = None  # client -> this server, gRPC Info round trip

    def to_row(self) -> list:
        return [round(self.t_s, 3), self.name, round(self.cpu_percent, 1), self.rss_bytes, self.tx_bytes,
                self.rx_bytes, None if self.rtt_s is None else round(self.rtt_s, 6)]


SAMPLE_COLUMNS = ["t_s", "name", "cpu_percent", "rss_bytes", "tx_bytes", "rx_bytes", "rtt_s"]


def parse_ss(text: str) -> dict[tuple[str, str], tuple[int, int, tuple[int, ...]]]:
    """`ss -tinpH` output -> {(local, peer): (bytes_acked, bytes_received, owner pids)} for sockets with an owner."""
    out: dict[tuple[str, str], tuple[int, int, tuple[int, ...]]] = {}
    header: list[str] | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            header = line.split()
            continue
        if header is None:
            continue
        users = " ".join(t for t in header if t.startswith("users:"))
        addrs = [t for t in header if ":" in t and not t.startswith("users:")]
        pids = _PID_RE.findall(users)
        acked, received = _ACKED_RE.search(line), _RECEIVED_RE.search(line)
        if pids and len(addrs) >= 2:
            out[(addrs[-2], addrs[-1])] = (int(acked.group(1)) if acked else 0,
                                           int(received.group(1)) if received else 0, tuple(map(int, pids)))
        header = None
    return out


class TelemetrySampler:
    """`with TelemetrySampler(tracked) as t: ...` then `t.samples`; samples every `interval_s` on a thread."""

    def __init__(self, tracked: Sequence[Tracked], interval_s: float = 1.0, rtt_timeout_s: float = 2.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        names = [t.name for t in tracked]
        if len(set(names)) != len(names) or SYSTEM in names:
            raise ValueError(f"tracked names must be unique and not {SYSTEM!r}: {names}")
        self.tracked = list(tracked)
        self.interval_s = interval_s
        self.rtt_timeout_s = rtt_timeout_s
        self.samples: list[Sample] = []
        self.t0 = time.perf_counter()
        self._procs: dict[int, psutil.Process] = {}  # cached, so cpu_percent() measures since the last call
        self._sockets: dict[tuple[str, ...], dict] = {}  # per namespace: socket -> last (acked, received)
        self._base: dict[str, tuple[int, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-telemetry", daemon=True)
        self._loop = None
        self._channels = None

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def __enter__(self) -> "TelemetrySampler":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        from swarmlm.client.channels import Channels, LoopThread
        from swarmlm.config import ClientConfig

        self._loop, self._channels = LoopThread.get(), Channels(ClientConfig(max_message_bytes=4 << 20))
        self.t0 = time.perf_counter()  # after the imports: the first sample comes one interval from now
        psutil.cpu_percent(None)
        self._base = self._bytes_by_name()  # counts start now, not when the sockets were opened
        for t in self.tracked:
            for p in self._tree(t.pid):
                p.cpu_percent(None)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def wait_past(self, t_s: float, timeout_s: float = 10.0) -> bool:
        """Block until a sample taken after t_s has been stored (a sample is stamped when it starts and stored
        when its RTT probes return), so a window's closing values are in `samples`."""
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            if self.samples and self.samples[-1].t_s > t_s:
                return True
            time.sleep(0.05)
        return False

    # ---- sampling ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        next_at = time.perf_counter() + self.interval_s
        while not self._stop.wait(max(next_at - time.perf_counter(), 0.0)):
            next_at += self.interval_s
            try:
                self.samples.extend(self.sample_once())
            except Exception as exc:  # a missed sample must not end the benchmark
                import logging

                logging.getLogger(__name__).warning("telemetry sample failed: %s", exc)

    def sample_once(self) -> list[Sample]:
        t = self.now()
        rtts = self._rtts()
        totals = self._bytes_by_name()
        out = []
        for tr in self.tracked:
            cpu = rss = 0.0
            for p in self._tree(tr.pid):
                try:
                    cpu += p.cpu_percent(None)
                    rss += p.memory_info().rss
                except psutil.Error:
                    continue
            tx, rx = totals.get(tr.name, (0, 0))
            bx, br = self._base.get(tr.name, (0, 0))
            out.append(Sample(t, tr.name, cpu, int(rss), tx - bx, rx - br, rtts.get(tr.name)))
        cores = psutil.cpu_count() or 1
        out.append(Sample(t, SYSTEM, psutil.cpu_percent(None) * cores, int(psutil.virtual_memory().used), 0, 0))
        return out

    def _tree(self, pid: int) -> list[psutil.Process]:
        """The process and its descendants, minus other tracked processes and their own descendants."""
        others = {t.pid for t in self.tracked} - {pid}
        try:
            root = self._proc(pid)
            todo, out = [root], []
            while todo:
                p = todo.pop()
                out.append(p)
                todo += [self._proc(c.pid) for c in p.children() if c.pid not in others]
            return out
        except psutil.Error:
            return []

    def _proc(self, pid: int) -> psutil.Process:
        p = self._procs.get(pid)
        if p is None or not p.is_running():
            p = self._procs[pid] = psutil.Process(pid)
        return p

    def _bytes_by_name(self) -> dict[str, tuple[int, int]]:
        owner: dict[int, str] = {}
        for tr in self.tracked:
            for p in self._tree(tr.pid):
                owner[p.pid] = tr.name
        for prefix in {tr.netns_prefix for tr in self.tracked}:
            seen = self._sockets.setdefault(prefix, {})
            text = subprocess.run([*prefix, "ss", "-tinpH"], capture_output=True, text=True, timeout=10).stdout
            for key, (acked, received, pids) in parse_ss(text).items():
                name = next((owner[p] for p in pids if p in owner), None)
                if name is None:
                    continue
                old = seen.get(key, (0, 0, name))
                if old[2] != name or acked < old[0] or received < old[1]:  # a new socket on an old 4-tuple: keep both
                    seen[(*key, len(seen))] = old
                    old = (0, 0, name)
                seen[key] = (acked, received, name)
        totals: dict[str, tuple[int, int]] = {}
        for seen in self._sockets.values():
            for acked, received, name in seen.values():
                tx, rx = totals.get(name, (0, 0))
                totals[name] = (tx + acked, rx + received)
        return totals

    def _rtts(self) -> dict[str, float]:
        from swarmlm.client.channels import info

        targets = [t for t in self.tracked if t.address]
        if not targets:
            return {}

        async def one(address: str) -> float | None:
            try:
                _, rtt = await info(self._channels, address, self.rtt_timeout_s)
                return rtt
            except Exception:
                return None

        async def all_() -> list[float | None]:
            return await asyncio.gather(*(one(t.address) for t in targets))

        results = self._loop.run(all_(), timeout=self.rtt_timeout_s + 1)
        return {t.name: r for t, r in zip(targets, results) if r is not None}


@dataclass(frozen=True)
class ProcessSummary:
    name: str
    samples: int
    mean_cpu_percent: float
    max_rss_bytes: int
    tx_bytes: int  # over the window
    rx_bytes: int
    median_rtt_s: float | None
    extra: dict = field(default_factory=dict, hash=False, compare=False)


def summarize(samples: Sequence[Sample], t_from: float, t_to: float) -> dict[str, ProcessSummary]:
    """Per process over [t_from, t_to] (sampler clock): means, peaks, and byte deltas across the window."""
    by_name: dict[str, list[Sample]] = {}
    for s in samples:
        by_name.setdefault(s.name, []).append(s)
    out = {}
    for name, rows in by_name.items():
        inside = [s for s in rows if t_from <= s.t_s <= t_to]
        before = [s for s in rows if s.t_s < t_from]
        after = [s for s in rows if s.t_s > t_to]
        if not inside and not after:
            continue
        inside = inside or after[:1]  # a run shorter than one interval: the next sample speaks for it
        # byte counters are cumulative: from the last sample before the window to the first one after it
        # (with no sample before the window, the sampler's own start is the baseline: counters are relative to it)
        end = after[0] if after else inside[-1]
        start_tx, start_rx = (before[-1].tx_bytes, before[-1].rx_bytes) if before else (0, 0)
        rtts = sorted(s.rtt_s for s in inside if s.rtt_s is not None)
        out[name] = ProcessSummary(
            name=name, samples=len(inside), mean_cpu_percent=sum(s.cpu_percent for s in inside) / len(inside),
            max_rss_bytes=max(s.rss_bytes for s in inside), tx_bytes=end.tx_bytes - start_tx,
            rx_bytes=end.rx_bytes - start_rx, median_rtt_s=rtts[len(rtts) // 2] if rtts else None,
        )
    return out


class RssSampler:
    """The peak RSS of a process, sampled on a thread."""

    def __init__(self, pid: int, period_s: float = 0.02) -> None:
        self.proc = psutil.Process(pid)
        self.period_s = period_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        return self.proc.memory_info().rss

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.rss())
            except psutil.Error:
                return
            self._stop.wait(self.period_s)

    def __enter__(self) -> "RssSampler":
        self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
