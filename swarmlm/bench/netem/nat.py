"""Hosts behind a home router: a real NAT made of network namespaces and an nftables masquerade.

    root ns ("the internet": bootstrap, relay, client) -- bridge slm<tag>br 10.213.S.1/24
        +-- veth slm<tag>r<i> -- [router slm-<tag>-r<i>: wan0 10.213.S.(10+i)/24 | lan0 10.213.L.(8i+1)/29]
                                     nft: masquerade out of wan0; forward only lan0 -> wan0 and replies
                                 -- [host slm-<tag>-h<i>: veth0 10.213.L.(8i+2)/29, default via the router]

A host behind a router connects out (its connections leave with the router's address) and nothing connects in:
the router forwards only packets of connections its LAN opened (conntrack; and, for a home given a forwarded
port, connections to that port: `forward`), and the LAN's /24 is unreachable from the root namespace (a route of
type unreachable, removed with the rest). Everything is named with the tag (netns.py's rules, so
`cleanup_leftovers` finds it) and removed on exit, with whatever runs inside.
"""
from __future__ import annotations

import atexit
import ipaddress
import os
import shutil
import subprocess

from swarmlm.bench.netem.netns import (NetemUnavailable, _free_subnet, _subnet_lock, _try, cleanup_leftovers,
                                       kill_netns_processes, namespaces_unsupported_reason, run)

_serial = iter(range(10**6))
_FORWARD = """
table ip slm_fwd {{
    chain prerouting {{
        type nat hook prerouting priority dstnat; policy accept;
        iifname "wan0" tcp dport {port} dnat to {host}
    }}
}}
"""
_RULES = """
table ip slm_nat {
    chain postrouting {
        type nat hook postrouting priority srcnat; policy accept;
        oifname "wan0" masquerade
    }
    chain forward {
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        ct status dnat accept
        iifname "lan0" oifname "wan0" accept
    }
    chain input {
        type filter hook input priority filter; policy drop;
        ct state established,related accept
        iifname "lan0" accept
    }
}
"""


def nat_unsupported_reason() -> str | None:
    """Why a NAT testbed cannot be built here, or None."""
    reason = namespaces_unsupported_reason()
    if reason is None and shutil.which("nft") is None:
        reason = "nft not found (apt-get install nftables; `make test` does)"
    return reason


class NatTestbed:
    """`with NatTestbed(n_behind) as nat:` -- `nat.public_ip` for processes in the root namespace to listen on,
    `nat.exec_prefix(i)` to run a process behind router i, `nat.router_ip(i)` (what the world sees of host i)."""

    __test__ = False

    def __init__(self, n_behind: int, forward: dict[int, int] | None = None, extra_ips: int = 0) -> None:
        """forward {i: port}: router i forwards that TCP port to its host (a home with port forwarding: reachable);
        extra_ips: more addresses of the root namespace on the bridge (`extra_ip(k)`, e.g. for delaying proxies)."""
        if not 1 <= n_behind <= 30 or not 0 <= extra_ips <= 50:
            raise ValueError(f"n_behind must be in [1, 30] and extra_ips in [0, 50], got {n_behind}, {extra_ips}")
        self.n_behind, self.forward, self.extra_ips = n_behind, dict(forward or {}), extra_ips
        self.tag = f"{os.getpid()}{chr(ord('n') + next(_serial) % 12)}"
        self.wan: ipaddress.IPv4Network | None = None
        self.lan: ipaddress.IPv4Network | None = None
        self._netns: list[str] = []
        self._links: list[str] = []  # veths first, the bridge last
        self._routes: list[str] = []

    @property
    def public_ip(self) -> str:
        return str(self.wan[1])

    def router_ip(self, i: int) -> str:
        return str(self.wan[10 + i])

    def extra_ip(self, k: int) -> str:
        return str(self.wan[200 + k])

    def host_ip(self, i: int) -> str:
        return str(self.lan[8 * i + 2])

    def netns(self, i: int) -> str:
        return f"slm-{self.tag}-h{i}"

    def exec_prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.netns(i)]

    def __enter__(self) -> "NatTestbed":
        reason = nat_unsupported_reason()
        if reason is not None:
            raise NetemUnavailable(reason)
        atexit.register(self.close)
        try:
            cleanup_leftovers()
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        bridge = f"slm{self.tag}br"
        with _subnet_lock():  # both /24s are on devices before another testbed looks for free ones
            self.wan = _free_subnet()
            self._links.append(bridge)
            run(["ip", "link", "add", bridge, "type", "bridge", "forward_delay", "0", "stp_state", "0"])
            run(["ip", "link", "set", bridge, "addrgenmode", "none"])
            run(["ip", "addr", "add", f"{self.public_ip}/24", "dev", bridge])
            for k in range(self.extra_ips):
                run(["ip", "addr", "add", f"{self.extra_ip(k)}/32", "dev", bridge])
            self.lan = _free_subnet()
            # a placeholder address keeps the LAN /24 ours while the lock is free (no route: a /32 on the bridge)
            run(["ip", "addr", "add", f"{self.lan[255 - 1]}/32", "dev", bridge])
        # private addresses are not routed on the internet: from here the LAN is unreachable (never the default route)
        run(["ip", "route", "add", "unreachable", str(self.lan)])
        self._routes.append(f"{self.lan}")  # (only once it is ours: never another testbed's)
        run(["ip", "link", "set", bridge, "up"])
        for i in range(self.n_behind):
            self._build_home(i, bridge)

    def _build_home(self, i: int, bridge: str) -> None:
        router, host = f"slm-{self.tag}-r{i}", self.netns(i)
        wan_veth, lan_ip = f"slm{self.tag}r{i}", self.lan[8 * i + 1]
        for ns in (router, host):
            self._netns.append(ns)  # recorded before the kernel makes it
            run(["ip", "netns", "add", ns])
        self._links.insert(0, wan_veth)
        run(["ip", "link", "add", wan_veth, "type", "veth", "peer", "name", "wan0", "netns", router])
        for args in (["addrgenmode", "none"], ["master", bridge], ["up"]):
            run(["ip", "link", "set", wan_veth, *args])
        run(["ip", "-n", router, "link", "add", "lan0", "type", "veth", "peer", "name", "veth0", "netns", host])
        _addr(router, "wan0", f"{self.router_ip(i)}/24")
        _addr(router, "lan0", f"{lan_ip}/29")
        _addr(host, "veth0", f"{self.host_ip(i)}/29")
        run(["ip", "-n", host, "route", "add", "default", "via", str(lan_ip)])
        run(["ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        nft = subprocess.run(["ip", "netns", "exec", router, "nft", "-f", "-"], input=_RULES,
                             capture_output=True, text=True)
        if nft.returncode == 0 and i in self.forward:
            rules = _FORWARD.format(port=self.forward[i], host=self.host_ip(i))
            nft = subprocess.run(["ip", "netns", "exec", router, "nft", "-f", "-"], input=rules,
                                 capture_output=True, text=True)
        if nft.returncode != 0:
            raise NetemUnavailable(f"nft in {router} failed: {nft.stderr.strip()}")

    def wan_bytes(self, i: int) -> int:
        """Bytes through router i's internet side so far, both directions (what its host's traffic costs)."""
        out = subprocess.run(["ip", "netns", "exec", f"slm-{self.tag}-r{i}", "cat", "/sys/class/net/wan0/statistics/"
                              "rx_bytes", "/sys/class/net/wan0/statistics/tx_bytes"], capture_output=True, text=True)
        return sum(int(x) for x in out.stdout.split())

    def close(self) -> list[str]:
        """Stop what runs inside, delete links and namespaces (the routers' rules go with them); returns errors."""
        errors: list[str] = []
        for ns in self._netns:
            kill_netns_processes(ns)
        for name in self._links:
            _try(["ip", "link", "del", name], errors)
        for ns in self._netns:
            _try(["ip", "netns", "del", ns], errors)
        for prefix in self._routes:
            _try(["ip", "route", "del", "unreachable", prefix], errors)
        self._routes.clear()
        self._links.clear()
        self._netns.clear()
        atexit.unregister(self.close)
        return errors


def _addr(netns: str, dev: str, cidr: str) -> None:
    run(["ip", "-n", netns, "link", "set", dev, "addrgenmode", "none"])
    run(["ip", "-n", netns, "addr", "add", cidr, "dev", dev])
    for d in (dev, "lo"):
        run(["ip", "-n", netns, "link", "set", d, "up"])

