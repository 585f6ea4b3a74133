"""The soak's faults that need more than a signal (swarmlm/bench/soak.py): a relay node that comes back at its address,
an nftables partition of a process tree's ports, and the ports a process tree listens on."""
from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import psutil

from swarmlm.swarm.local import LocalSwarm


class RelayNode:
    """A `swarmlm dht` node (every one relays) with a fixed identity and port: it comes back at the same address."""

    def __init__(self, swarm: LocalSwarm, name: str, bootstrap: list[str], log_dir: Path) -> None:
        self.swarm, self.name, self.bootstrap = swarm, name, bootstrap
        self.identity = log_dir / f"{name}.key"
        with socket.socket() as sock:  # a free port, kept across restarts
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.addrs: list[str] = []
        self.start()

    def start(self) -> None:
        extra = ["--initial-peers", *self.bootstrap, "--identity", str(self.identity), "--port", str(self.port)]
        self.proc, addrs = self.swarm.spawn_dht(self.name, extra=extra)
        if self.addrs and addrs != self.addrs:
            raise RuntimeError(f"{self.name} came back at {addrs}, not at {self.addrs}")
        self.addrs = addrs


class Partition:
    """An nftables table dropping TCP to and from `ports` (on every interface, loopback included)."""

    TABLE = "swarmlm_soak"

    def __init__(self, ports: list[int]) -> None:
        self.ports = sorted(ports)

    def __enter__(self) -> "Partition":
        if not self.ports:
            raise RuntimeError("no listening ports to partition")
        ports = ", ".join(map(str, self.ports))
        rules = (f"table inet {self.TABLE} {{\n chain input {{ type filter hook input priority -10; "
                 f"tcp dport {{ {ports} }} drop; tcp sport {{ {ports} }} drop; }}\n}}\n")
        subprocess.run(["nft", "-f", "-"], input=rules, text=True, check=True, capture_output=True)
        return self

    def __exit__(self, *exc) -> None:
        self.clear()

    @classmethod
    def clear(cls) -> None:
        subprocess.run(["nft", "delete", "table", "inet", cls.TABLE], capture_output=True)


def listen_ports(pid: int) -> list[int]:
    ports = set()
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            ports |= {c.laddr.port for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            continue
    return list(ports)
