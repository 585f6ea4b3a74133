"""A testbed of N emulated hosts whose links follow a profile; everything it creates is removed on exit.

Modes:
  namespaces  each host is a network namespace with a veth into a bridge in the root namespace; the kernel
              enforces each host's access rate with tbf on both ends of its veth; a relay in the root
              namespace adds delay/jitter/loss (this kernel has no netem). Hosts reach each other and the
              root namespace directly on the bridge (rate-limited, not delayed) and through `expose`
              addresses (rate-limited and delayed).
  relay-only  no rights needed: hosts are loopback addresses 127.213.S.i, the relay (at 127.214.S.i) adds
              delay and rate.

Layout in namespaces mode (S = a free /24 in 10.213.0.0/16, found by scanning the root namespace):
    client (root ns) -- bridge slm<tag>br 10.213.S.1 -- veth slm<tag><i> =tbf= [slm-<tag>-h<i>: veth0 10.213.S.(i+2)]
    relay (root ns): listens on 10.213.S.(128+i):<port> (on the bridge), forwards to 10.213.S.(i+2):<port>.
The relay tells sources apart by their IP, so one exposed address per (host, port) serves the client and
every other host, each with its own link profile.
"""
from __future__ import annotations

import atexit
import itertools
import logging
import os
import signal
import subprocess
import threading
from typing import Literal, Sequence

from swarmlm.bench.netem import netns
from swarmlm.bench.netem.netns import MAX_HOSTS, HostNamespaces, NetemUnavailable, cleanup_leftovers, leftovers
from swarmlm.bench.netem.link_probe import measure_rtt, start_probe_server
from swarmlm.bench.netem.profile import CLIENT, LinkMatrix, LinkProfile
from swarmlm.bench.netem.delay_relay import DirectionSpec, ListenSpec, RelayProcess, RelayRoute

Mode = Literal["auto", "namespaces", "relay-only"]
log = logging.getLogger("swarmlm.bench.netem")

_CALIBRATION_ONE_WAY_S = 0.5e-3
_MAX_OVERHEAD_S = 0.4e-3  # ~0.15 ms on an idle 2-core VM; more means other load disturbed the calibration
_serial = itertools.count()


class Testbed:
    """`with Testbed(n, network) as tb:` then start servers with `tb.spawn(i, argv)`, dial `tb.expose(i, port)`."""

    __test__ = False  # a name starting with "Test" is not a pytest test class

    def __init__(self, n_hosts: int, network: LinkProfile | LinkMatrix, mode: Mode = "auto") -> None:
        if not 1 <= n_hosts <= MAX_HOSTS:
            raise ValueError(f"n_hosts must be in [1, {MAX_HOSTS}], got {n_hosts}")
        matrix = LinkMatrix.uniform(n_hosts, network) if isinstance(network, LinkProfile) else network
        if matrix.n_hosts != n_hosts:
            raise ValueError(f"network has {matrix.n_hosts} hosts but n_hosts={n_hosts}")
        self.n_hosts = n_hosts
        self.network = matrix
        self.requested_mode: Mode = mode
        self.mode: Literal["namespaces", "relay-only"] | None = None  # set on entry
        self.fallback_reason: str | None = None  # why "auto" did not get namespaces
        self.tag = f"{os.getpid()}{chr(ord('a') + next(_serial) % 26)}"  # unique per live testbed
        self._hosts = HostNamespaces(self.tag, n_hosts)
        self._relay: RelayProcess | None = None
        self._exposed: dict[tuple[int, int, int], str] = {}
        self._spawned: list[subprocess.Popen] = []
        self._old_handlers: dict[int, object] = {}
        self._closed = False
        self.path_overhead_s = 0.0  # RTT the emulated path costs with no added delay; subtracted from delays

    # ------------------------------------------------------------ public API

    def __enter__(self) -> "Testbed":
        self._install_signal_handlers()
        atexit.register(self.close)
        try:
            cleanup_leftovers()
            self._choose_mode_and_build()
            self._relay = RelayProcess()
            self.path_overhead_s = self._calibrate()
        except BaseException:
            self.close()  # an interrupted or failed setup leaves nothing behind
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def exec_prefix(self, i: int) -> list[str]:
        """Prefix for a command that must run on host i (`ip netns exec ...`, or nothing on loopback)."""
        self._check_host(i)
        return ["ip", "netns", "exec", self._hosts.netns(i)] if self.mode == "namespaces" else []

    def host_ip(self, i: int) -> str:
        """The address host i's servers bind to (reachable undelayed from the client and other hosts)."""
        self._check_host(i)
        if self.mode == "namespaces":
            return self._hosts.host_ip(i)
        return f"127.213.{self._loopback_octet}.{i + 1}"

    def announce_host(self, i: int) -> str:
        """Where the relay stands in for host i: a server on host i announces this (`--announce-host`)."""
        self._check_host(i)
        if self.mode == "namespaces":
            return self._hosts.front_ip(i)
        return f"127.214.{self._loopback_octet}.{i + 1}"

    def expose(self, i: int, port: int, src: int = CLIENT) -> str:
        """"host:port" through which the client and other hosts reach host i's `port` over the emulated link.

        The address is `announce_host(i):port` (same port), so a server announcing that host is dialed through
        the relay. It may be created before the server listens. In namespaces mode the relay recognizes the
        caller by its source IP, so this one address gives every caller its own link (`src` is ignored). On
        loopback all callers look alike, so a server-to-server link needs its own address: pass `src` (a host
        index) and get another port on the same host.
        """
        self._check_host(i)
        if not 0 < port < 65536:
            raise ValueError(f"port must be in (0, 65536), got {port}")
        key = (i, port, CLIENT if self.mode == "namespaces" else src)
        if key not in self._exposed:
            self._exposed[key] = self._listen(i, port, src)
        return self._exposed[key]

    def spawn(self, i: int, argv: Sequence[str], **popen_kwargs: object) -> subprocess.Popen:
        """Start a process on host i; it is terminated when the testbed closes."""
        proc = subprocess.Popen(self.exec_prefix(i) + list(argv), **popen_kwargs)
        self._spawned.append(proc)
        return proc

    def close(self) -> None:
        """Remove everything this testbed created; safe to call twice and from atexit/signal paths."""
        if self._closed:
            return
        self._closed = True
        for proc in self._spawned:
            _stop_process(proc)
        if self._relay is not None:
            self._relay.close()
        errors = self._hosts.remove()
        left = [x for x in leftovers() if self.tag in x]
        if left or errors:
            log.warning("netem testbed %s cleanup: errors=%s leftovers=%s", self.tag, errors, left)
        atexit.unregister(self.close)
        self._restore_signal_handlers()

    # ------------------------------------------------------------ set-up

    def _choose_mode_and_build(self) -> None:
        if self.requested_mode == "relay-only":
            self.mode = "relay-only"
            return
        reason = netns.namespaces_unsupported_reason()  # looked up late: tests fake it
        if reason is None:
            try:
                self._hosts.build([self._access_rate_bps(i) for i in range(self.n_hosts)])
                self.mode = "namespaces"
                return
            except NetemUnavailable as exc:
                reason = str(exc)
                self._hosts.remove()
        if self.requested_mode == "namespaces":
            raise NetemUnavailable(f"namespaces mode is unavailable: {reason}")
        self.fallback_reason = reason
        self.mode = "relay-only"
        log.warning("netem: namespaces mode unavailable (%s); falling back to relay-only (loopback, rate and "
                    "delay in the relay)", reason)

    # ------------------------------------------------------------ links

    def _access_rate_bps(self, i: int) -> float | None:
        """tbf rate of host i's veth: the fastest link it takes part in (slower pairs are paced by the relay)."""
        rates = [self.network.link(i, j).rate_bps for j in range(CLIENT, self.n_hosts)]
        return None if any(r is None for r in rates) else max(rates)

    def _path_cap_bps(self, src: int, dst: int) -> float:
        """What the kernel already enforces between src and dst (inf when nothing does)."""
        if self.mode != "namespaces":
            return float("inf")
        caps = [self._access_rate_bps(x) for x in (src, dst) if x != CLIENT]
        return min((c for c in caps if c is not None), default=float("inf"))

    def _calibrate(self) -> float:
        """The RTT the emulated path adds by itself: the relay's send, veth and bridge, the receivers' wake-ups.

        Measured once through the relay to a probe on host 0 with a known delay (0.5 ms each way: waking after
        a wait costs more than in a busy loop, so the probe must wait like real traffic does). Each direction's
        delay is then shortened by half of it, so a TCP echo measures the profile's RTT, as a ping would on
        a real link.
        """
        proc, port = start_probe_server(self.host_ip(0), 0, self.exec_prefix(0))
        try:
            d = DirectionSpec(delay_s=_CALIBRATION_ONE_WAY_S)
            spec = ListenSpec(self.announce_host(0), 0, self.host_ip(0), port, {"*": RelayRoute(d, d)})
            host, relay_port = self._relay.listen(spec)
            rtt_s = measure_rtt(f"{host}:{relay_port}", samples=100).p25_s  # other load only ever adds
        finally:
            _stop_process(proc)
        overhead_s = max(0.0, rtt_s - 2 * _CALIBRATION_ONE_WAY_S)
        if overhead_s > _MAX_OVERHEAD_S:  # a busy machine, not the path: do not shorten delays by that much
            log.warning("netem: path overhead measured %.0f us (machine busy?); using %.0f us",
                        overhead_s * 1e6, _MAX_OVERHEAD_S * 1e6)
            overhead_s = _MAX_OVERHEAD_S
        floor = [(a, b) for a in range(CLIENT, self.n_hosts) for b in range(a + 1, self.n_hosts)
                 if self.network.link(a, b).rtt_s < overhead_s]
        if floor:
            log.warning("netem: links %s ask for less RTT than this path's floor of %.0f us; they get the floor",
                        floor[:5], overhead_s * 1e6)
        return overhead_s

    def _direction(self, src: int, dst: int) -> DirectionSpec:
        link = self.network.link(src, dst)
        rate = link.effective_rate_bps
        delay_s = max(0.0, link.one_way_s - self.path_overhead_s / 2)
        return DirectionSpec(delay_s=delay_s, jitter_s=min(link.jitter_s, delay_s),
                             rate_bps=rate if rate is not None and rate < self._path_cap_bps(src, dst) else None,
                             loss=link.loss, retransmit_s=link.rtt_s, link_id=f"{src}>{dst}")

    def _route(self, src: int, dst: int) -> RelayRoute:
        return RelayRoute(forward=self._direction(src, dst), backward=self._direction(dst, src))

    def _listen(self, i: int, port: int, src: int) -> str:
        if self.mode == "namespaces":
            routes = {"*": self._route(CLIENT, i)}
            routes.update({self.host_ip(k): self._route(k, i) for k in range(self.n_hosts)})
        else:
            routes = {"*": self._route(src, i)}
        # the relay must hold a few bandwidth-delay products per direction, or it would cap the rate itself
        link = self.network.link(src, i)
        held_s = link.one_way_s + link.jitter_s + (link.rtt_s if link.loss > 0 else 0.0)
        buffer_bytes = int(max(4 << 20, 4 * (link.rate_bps or 10e9) / 8 * held_s))
        same_port = port if src == CLIENT or self.mode == "namespaces" else 0
        spec = ListenSpec(self.announce_host(i), same_port, self.host_ip(i), port, routes, buffer_bytes)
        host, relay_port = self._relay.listen(spec)
        return f"{host}:{relay_port}"

    # ------------------------------------------------------------ helpers

    @property
    def _loopback_octet(self) -> int:
        return int(self.tag[:-1]) % 200 + 20  # spread testbeds of different processes over 127.213.20-219.x

    def _check_host(self, i: int) -> None:
        if self.mode is None:
            raise RuntimeError("use the testbed inside `with Testbed(...) as tb:`")
        if not 0 <= i < self.n_hosts:
            raise ValueError(f"host {i} is not in [0, {self.n_hosts})")

    def _install_signal_handlers(self) -> None:
        # SIGTERM/SIGHUP would end the process without unwinding; make them raise so `with` cleans up.
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:
                self._old_handlers[sig] = signal.signal(sig, _raise_system_exit)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)
        self._old_handlers.clear()


def _raise_system_exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _stop_process(proc: subprocess.Popen, timeout_s: float = 3.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
