"""Kernel plumbing of the namespaces mode: a bridge, one namespace per host, tbf-limited veths; and cleanup.

Every object is named with a testbed tag `<pid><letter>` (netns `slm-<tag>-h<i>`, links `slm<tag><i>` and
`slm<tag>br`), so leftovers of a process that died without cleaning up can be found and removed later.
Only addresses of 10.213.0.0/16 are used, and only on devices created here.
"""
from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from typing import Iterator, Sequence

from swarmlm.errors import SwarmError

log = logging.getLogger("swarmlm.bench.netem")

_SUBNET = ipaddress.ip_network("10.213.0.0/16")
_LOCK_NAME = b"\0slm-netem-subnet-lock"  # abstract socket: no file to leave behind, freed when its owner dies
_NETNS_RE = re.compile(r"^slm-(\d+)[a-z]-[hr]\d+$")  # hosts; routers of nat.py
_LINK_RE = re.compile(r"^slm(\d+)[a-z](\d+|br|r\d+)$")
FRONT_OFFSET = 128  # in a /24: hosts at .2 .. .(n+1), relay fronts at .128 .. .(127+n)
MAX_HOSTS = 120


class NetemUnavailable(SwarmError, RuntimeError):
    """The requested emulation mode cannot run here (rights, tools or kernel features missing)."""


class HostNamespaces:
    """The bridge and host namespaces of one testbed. Names are recorded before each object is created."""

    def __init__(self, tag: str, n_hosts: int) -> None:
        self.tag, self.n_hosts = tag, n_hosts
        self.subnet: ipaddress.IPv4Network | None = None
        self.netns_created: list[str] = []
        self.links_created: list[str] = []  # veths first, the bridge last: the order of removal

    def netns(self, i: int) -> str:
        return f"slm-{self.tag}-h{i}"

    def host_ip(self, i: int) -> str:
        return str(self.subnet[i + 2])

    def front_ip(self, i: int) -> str:
        """Address on the bridge where the relay stands in for host i (same port numbers as the host)."""
        return str(self.subnet[FRONT_OFFSET + i])

    @property
    def bridge_ip(self) -> str:
        return str(self.subnet[1])

    def build(self, access_rates_bps: Sequence[float | None]) -> None:
        """Create everything; host i's veth is limited to access_rates_bps[i] in both directions."""
        bridge = f"slm{self.tag}br"
        with _subnet_lock():  # held until our address is on the bridge, so no other testbed picks it too
            self.subnet = _free_subnet()
            self.links_created.append(bridge)
            run(["ip", "link", "add", bridge, "type", "bridge", "forward_delay", "0", "stp_state", "0"])
            run(["ip", "link", "set", bridge, "addrgenmode", "none"])  # no IPv6 link-local chatter
            run(["ip", "addr", "add", f"{self.bridge_ip}/24", "dev", bridge])
            for i in range(self.n_hosts):
                run(["ip", "addr", "add", f"{self.front_ip(i)}/32", "dev", bridge])
        run(["ip", "link", "set", bridge, "up"])
        for i, rate in enumerate(access_rates_bps):
            self.build_host(i, bridge, rate)

    def build_host(self, i: int, bridge: str, rate_bps: float | None) -> None:
        netns, veth = self.netns(i), f"slm{self.tag}{i}"
        self.netns_created.append(netns)  # recorded first: a signal may stop us right after the kernel made it
        run(["ip", "netns", "add", netns])
        self.links_created.insert(0, veth)
        run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "veth0", "netns", netns])
        for args in (["addrgenmode", "none"], ["master", bridge], ["up"]):
            run(["ip", "link", "set", veth, *args])
        run(["ip", "-n", netns, "link", "set", "veth0", "addrgenmode", "none"])
        run(["ip", "-n", netns, "addr", "add", f"{self.host_ip(i)}/24", "dev", "veth0"])
        for dev in ("veth0", "lo"):
            run(["ip", "-n", netns, "link", "set", dev, "up"])
        if rate_bps is not None:  # into the host (root side egress) and out of it (namespace side egress)
            run(["tc", "qdisc", "add", "dev", veth, "root", *_tbf_args(rate_bps)])
            run(["tc", "-n", netns, "qdisc", "add", "dev", "veth0", "root", *_tbf_args(rate_bps)])

    def remove(self) -> list[str]:
        """Stop what runs inside, delete links (qdiscs go with them) and namespaces; returns errors."""
        errors: list[str] = []
        for netns in self.netns_created:
            kill_netns_processes(netns)  # a process inside would keep the namespace alive after `netns del`
        for name in self.links_created:
            _try(["ip", "link", "del", name], errors)
        for netns in self.netns_created:
            _try(["ip", "netns", "del", netns], errors)
        self.links_created.clear()
        self.netns_created.clear()
        return errors


def run(argv: list[str]) -> None:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise NetemUnavailable(f"`{' '.join(argv)}` failed: {result.stderr.strip() or result.returncode}")


def _try(argv: list[str], errors: list[str]) -> None:
    """Run a removal; an object that is already gone is not an error."""
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0 and "Cannot find" not in result.stderr and "No such" not in result.stderr:
        errors.append(f"{' '.join(argv)}: {result.stderr.strip()}")


def _tbf_args(rate_bps: float) -> list[str]:
    # burst: ~1 ms of traffic but at least 32 KiB, or tbf falls short of high rates between timer ticks;
    # latency bounds the queue (the veth leg has ~0 RTT, so TCP keeps it short anyway).
    burst_bytes = int(max(32 << 10, rate_bps / 8 * 1e-3))
    return ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst_bytes), "latency", "50ms"]


@contextlib.contextmanager
def _subnet_lock(timeout_s: float = 30.0) -> Iterator[None]:
    """A machine-wide mutex between testbeds: binding an abstract unix socket name succeeds for one at a time."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock.bind(_LOCK_NAME)
            break
        except OSError:
            if time.monotonic() > deadline:
                sock.close()
                raise NetemUnavailable("another testbed held the subnet lock for 30 s") from None
            time.sleep(0.01)
    try:
        yield
    finally:
        sock.close()


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of 10.213.0.0/16 that no address or route of the root namespace overlaps (a NAT testbed's LAN lives
    in its namespaces, seen here only as its unreachable route, which a killed run may also leave behind)."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True).stdout
    used = [ipaddress.ip_interface(m).network for m in re.findall(r"inet (\S+)", out)]
    routes = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True).stdout
    used += [ipaddress.ip_network(m, strict=False) for m in re.findall(r"\b(\d+\.\d+\.\d+\.\d+/\d+)", routes)]
    for subnet in _SUBNET.subnets(new_prefix=24):
        if not any(subnet.overlaps(u) for u in used):
            return subnet
    raise NetemUnavailable(f"no free /24 left in {_SUBNET}")


def kill_netns_processes(netns: str, timeout_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL, whatever runs in one of our namespaces."""
    def pids() -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 1.0)):
        alive = pids()
        for pid in alive:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while alive and time.monotonic() < deadline:
            time.sleep(0.02)
            alive = pids()
        if not alive:
            return


def namespaces_unsupported_reason() -> str | None:
    """Why namespaces mode cannot work here, or None when it should (building it is the final test)."""
    if os.geteuid() != 0:
        return "not running as root (network namespaces, veths and tc need CAP_NET_ADMIN)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"missing tools on PATH: {', '.join(missing)} (install iproute2)"
    return None


def leftovers() -> list[str]:
    """Namespaces and links named like ours that exist now (of any testbed, live or dead)."""
    if namespaces_unsupported_reason() is not None:
        return []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in netns.splitlines() if _NETNS_RE.match(line.split()[0])]
    names += [m for m in re.findall(r"^\d+: ([^:@]+)", links, flags=re.M) if _LINK_RE.match(m)]
    return names


def cleanup_leftovers() -> list[str]:
    """Remove namespaces (and what runs in them) and links of testbeds whose process is gone."""
    removed = []
    for name in leftovers():
        match = _NETNS_RE.match(name) or _LINK_RE.match(name)
        if _alive(int(match.group(1))):
            continue
        if name.startswith("slm-"):
            kill_netns_processes(name)
            _try(["ip", "netns", "del", name], [])
        else:
            _try(["ip", "link", "del", name], [])
        removed.append(name)
    if removed:
        log.warning("netem: removed leftovers of dead testbeds: %s", removed)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
