"""A soak (issue 39): a swarm with replicas, a gateway and 8 checking clients (swarmlm/bench/soak_clients.py) under
one fault per `fault_every_s` from a seeded schedule, for `duration_s`; every process's RSS, open files and threads
and every server's sessions and prefix entries sampled each `sample_every_s`. At the end: the clients stop, the
sessions left on the servers, the swarm stops, and the processes still alive 10 s later (orphans).

The schedule takes the fault kinds in turn, each round of them in a seeded order: every kind is applied once in any
`len(faults)` faults in a row (a kind with no server to take it waits for the next tick).

Faults (one at a time, on a server whose blocks another server also serves):
  kill       SIGKILL of the server's main pid (its helpers must die with it), restarted on the same blocks 5 s later
  hang       SIGSTOP for 8-30 s, then SIGCONT
  partition  every port the server's process tree listens on dropped by nftables (in and out) for 30 s
  move       SIGTERM, restarted on other blocks (the ones that leave the fewest blocks single-served)
  relay      SIGKILL of a relay node (`swarmlm dht` with a fixed identity and port; the next one in turn), back at the
             same address 5 s later: the relayed servers listening through it move to another relay
Servers in `relayed` are behind NAT (`--reachability relayed`), reached through the `relays` relay nodes (listed
first in everyone's initial peers, so relayed servers listen through them; the bootstrap node relays too).
The CLI is benchmarks/soak.py; the short form is tests/test_soak.py."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from swarmlm.bench.soak_clients import KINDS
from swarmlm.bench.soak_faults import Partition, RelayNode, listen_ports
from swarmlm.swarm.local import LocalSwarm, ServerProcess
from swarmlm.types import BlockRange

FAULTS = ("kill", "hang", "partition", "move", "relay")
CLIENTS = ("greedy", "greedy", "sampling", "speculative", "beam", "api", "api", "train")


@dataclass(frozen=True)
class SoakConfig:
    model_dir: str
    out_dir: Path
    duration_s: float = 3600.0
    fault_every_s: float = 60.0  # one fault per interval, the first one interval after the clients start
    partition_s: float = 30.0
    hang_s: tuple[float, float] = (8.0, 30.0)  # a SIGSTOP lasts uniform(lo, hi) seconds
    sample_every_s: float = 10.0
    seed: int = 0
    ranges: tuple[BlockRange, ...] = (BlockRange(0, 3), BlockRange(3, 6), BlockRange(0, 3), BlockRange(3, 6))
    clients: tuple[str, ...] = CLIENTS
    faults: tuple[str, ...] = ("kill", "hang", "partition", "move")
    relayed: tuple[int, ...] = ()  # slots (indices in `ranges`) of the servers behind NAT
    relays: int = 0  # relay nodes besides the bootstrap node (the "relay" fault kills them)

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.fault_every_s <= 0 or self.sample_every_s <= 0:
            raise ValueError("duration_s, fault_every_s and sample_every_s must be > 0")
        if unknown := set(self.clients) - set(KINDS) or set(self.faults) - set(FAULTS):
            raise ValueError(f"unknown client kinds or faults: {sorted(unknown)}")
        if not set(self.relayed) <= set(range(len(self.ranges))):
            raise ValueError(f"relayed slots {sorted(self.relayed)} are not servers (0..{len(self.ranges) - 1})")
        if "relay" in self.faults and self.relays < 1:
            raise ValueError("the relay fault needs relays >= 1 (relay nodes to kill)")


@dataclass
class Fault:
    t: float  # seconds since the clients started
    kind: str
    slot: int  # the server's index in swarm.servers
    detail: dict = field(default_factory=dict)


class Soak:
    def __init__(self, config: SoakConfig) -> None:
        self.config = config
        self.out = Path(config.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.rng = random.Random(config.seed)
        self.swarm = LocalSwarm(config.model_dir, log_dir=self.out / "logs")
        self.gateway = None
        self.clients: list[tuple[str, subprocess.Popen]] = []
        self.stop_file = self.out / "stop"
        self.roles: dict[int, str] = {}  # pid -> role, for every process we started
        self.seen: dict[int, tuple[str, float]] = {}  # pid -> (role, create time): every process ever sampled
        self.faults: list[Fault] = []
        self.busy: set[int | str] = set()  # slots under a fault now (relay nodes: "relay<i>")
        self.relay_nodes: list[RelayNode] = []
        self.next_relay = 0  # the relay the next relay fault kills (in turn)
        self.t0 = 0.0
        self._done = threading.Event()

    # ---- setup ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        from swarmlm.api.process import GatewayProcess

        self.stop_file.unlink(missing_ok=True)
        self.swarm.start_dht()
        self.roles[self.swarm.dht_proc.pid] = "dht"
        bootstrap = list(self.swarm.initial_peers)
        self.relay_nodes = [RelayNode(self.swarm, f"relay{i}", bootstrap, self.out / "logs")
                            for i in range(self.config.relays)]
        for i, node in enumerate(self.relay_nodes):
            self.roles[node.proc.pid] = f"relay{i}"
        # relays first: a server behind NAT listens through the first relay that takes it
        self.swarm.initial_peers = [a for node in self.relay_nodes for a in node.addrs] + bootstrap
        servers = [self.swarm.start_server(r, wait=False, extra=self._extra(slot))
                   for slot, r in enumerate(self.config.ranges)]
        self.gateway = GatewayProcess(self.config.model_dir, self.swarm.initial_peers,
                                      extra=["--speculative", "auto"], log_path=self.out / "logs" / "api.err").start()
        self.roles[self.gateway.proc.pid] = "api"
        self.swarm.wait_ready(servers)
        for slot, s in enumerate(servers):
            self.roles[s.proc.pid] = f"server{slot}"
        for i, kind in enumerate(self.config.clients):
            self._start_client(i, kind)
        self._wait_clients_ready()
        self.t0 = time.time()

    def _extra(self, slot: int) -> list[str]:
        return ["--reachability", "relayed"] if slot in self.config.relayed else []

    def _wait_clients_ready(self, timeout_s: float = 600.0) -> None:
        """Until every client printed its ready line (a busy machine takes a while to import torch 8 times)."""
        deadline = time.time() + timeout_s
        for i, (kind, proc) in enumerate(self.clients):
            path = self.out / f"client{i}-{kind}.jsonl"
            while not path.read_text().strip():
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"client {i} ({kind}) did not start: see {self.out / 'logs'}")
                time.sleep(0.5)

    def _start_client(self, i: int, kind: str) -> None:
        cmd = [sys.executable, "-m", "swarmlm.bench.soak_clients", kind, self.config.model_dir, str(self.stop_file),
               str(self.config.seed * 100 + i), "--initial-peers", *self.swarm.initial_peers,
               "--gateway", self.gateway.url, "--gateway-model", self.gateway.model]
        log = open(self.out / "logs" / f"client{i}-{kind}.err", "w")
        proc = subprocess.Popen(cmd, stdout=open(self.out / f"client{i}-{kind}.jsonl", "w"), stderr=log,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self.clients.append((kind, proc))
        self.roles[proc.pid] = f"client{i}-{kind}"

    # ---- faults ---------------------------------------------------------------------------------------------
    def _fault_loop(self) -> None:
        k, kinds = 1, []
        while not self._done.wait(max(0.0, self.t0 + k * self.config.fault_every_s - time.time())):
            if time.time() - self.t0 > self.config.duration_s - 5:
                return
            kinds = kinds or self.rng.sample(self.config.faults, len(self.config.faults))  # the next round
            kind = kinds[0]
            slot = self._relay_target() if kind == "relay" else self._target()
            if slot is not None:
                kinds.pop(0)
                fault = Fault(round(time.time() - self.t0, 1), kind, slot)
                self.faults.append(fault)
                self._append("faults.jsonl", asdict(fault))
                self.busy.add(_busy_key(fault))
                threading.Thread(target=self._apply, args=(fault,), daemon=True).start()
            k += 1

    def _target(self) -> int | None:
        """A live server not under a fault whose every block another healthy server serves too."""
        servers = self.swarm.servers[:len(self.config.ranges)]  # (a server starting is appended for a moment)
        healthy = [i for i, s in enumerate(servers) if s.alive and s.address and i not in self.busy]
        ok = [i for i in healthy if all(any(_blocks(servers[j]) >= {b} for j in healthy if j != i)
                                        for b in _blocks(servers[i]))]
        return self.rng.choice(ok) if ok else None

    def _relay_target(self) -> int | None:
        """The next relay node in turn (the one a relayed server moved to after the last relay fault, mostly)."""
        i = self.next_relay
        if f"relay{i}" in self.busy:
            return None
        self.next_relay = (i + 1) % len(self.relay_nodes)
        return i

    def _apply(self, fault: Fault) -> None:
        server = self.swarm.servers[fault.slot] if fault.kind != "relay" else None
        try:
            if fault.kind == "relay":
                node = self.relay_nodes[fault.slot]
                node.proc.kill()  # the main pid only: its p2pd must die with it
                node.proc.wait(60)
                time.sleep(5)
                node.start()  # (the same identity and port: the same address)
                self.roles[node.proc.pid] = node.name
            elif fault.kind == "kill":
                server.proc.kill()  # the main pid only: what it started must die with it (swarm/lifetime.py)
                time.sleep(5)
                self._restart(fault.slot, _range(server))
            elif fault.kind == "hang":
                server.proc.send_signal(signal.SIGSTOP)
                fault.detail["s"] = s = round(self.rng.uniform(*self.config.hang_s), 1)
                time.sleep(s)
                server.proc.send_signal(signal.SIGCONT)
            elif fault.kind == "partition":
                with Partition(listen_ports(server.proc.pid)) as part:
                    fault.detail["ports"] = part.ports
                    time.sleep(self.config.partition_s)
            elif fault.kind == "move":
                new = self._move_target(fault.slot)
                fault.detail["to"] = f"{new.start}:{new.end}"
                server.proc.send_signal(signal.SIGTERM)
                server.proc.wait(60)
                self._restart(fault.slot, new)
        except Exception as exc:  # recorded: a fault the harness could not apply is part of the result
            fault.detail["error"] = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            fault.detail["end"] = round(time.time() - self.t0, 1)
            self._append("faults.jsonl", {"end": asdict(fault)})
            self.busy.discard(_busy_key(fault))

    def _restart(self, slot: int, blocks: BlockRange) -> None:
        old = self.swarm.servers[slot]
        old.proc.wait(60)  # (reaped: no zombie)
        if old.proc.stdout:
            old.proc.stdout.close()
        new = self.swarm.start_server(blocks, wait=False, extra=self._extra(slot))  # (appended: slotted once ready)
        self.roles[new.proc.pid] = f"server{slot}"
        try:
            self.swarm.wait_ready([new])
        finally:
            self.swarm.servers.remove(new)
            self.swarm.servers[slot] = new

    def _move_target(self, slot: int) -> BlockRange:
        others = [_blocks(s) for i, s in enumerate(self.swarm.servers) if i != slot and s.alive]
        n = max(max(b) for b in map(_blocks, self.swarm.servers)) + 1
        cands = [BlockRange(a, a + 3) for a in range(n - 2)] + [BlockRange(0, n)]

        def single(r: BlockRange) -> int:  # blocks served by fewer than 2 servers if this one takes r
            return sum(sum(b in o for o in others) + (r.start <= b < r.end) < 2 for b in range(n))
        best = min(map(single, cands))
        cur = _range(self.swarm.servers[slot])
        return self.rng.choice([r for r in cands if single(r) == best and r != cur] or [cur])

    # ---- sampling -------------------------------------------------------------------------------------------
    def _sample_loop(self) -> None:
        while not self._done.wait(self.config.sample_every_s):
            self._append("samples.jsonl", self.sample())

    def sample(self) -> dict:
        procs = []
        for p in [psutil.Process(), *psutil.Process().children(recursive=True)]:
            try:
                with p.oneshot():
                    role = self.roles.get(p.pid) or f"{self.roles.get(p.ppid(), '?')}/{p.name()}"
                    if p.pid == psutil.Process().pid:
                        role = "harness"
                    self.seen.setdefault(p.pid, (role, p.create_time()))
                    procs.append({"pid": p.pid, "role": role, "rss_mb": round(p.memory_info().rss / 2**20, 1),
                                  "fds": p.num_fds(), "threads": p.num_threads(), "status": p.status()})
            except psutil.Error:
                continue
        servers = [_server_state(s, slot, slot in self.busy)
                   for slot, s in enumerate(self.swarm.servers[:len(self.config.ranges)])]
        return {"t": round(time.time() - self.t0, 1), "procs": procs, "servers": servers}

    # ---- the run --------------------------------------------------------------------------------------------
    def run(self) -> dict:
        try:
            self.start()
            threads = [threading.Thread(target=f, daemon=True) for f in (self._fault_loop, self._sample_loop)]
            for t in threads:
                t.start()
            self._append("samples.jsonl", self.sample())
            self._done.wait(self.config.duration_s)
            self._done.set()
            for t in threads:
                t.join(60)
            self._wait_faults()
            return self.finish()
        finally:
            self._done.set()
            self.stop_file.touch()
            self._stop_all()

    def _wait_faults(self, timeout_s: float = 120.0) -> None:
        deadline = time.time() + timeout_s
        while self.busy and time.time() < deadline:
            time.sleep(0.5)

    def finish(self) -> dict:
        self.stop_file.touch()
        for _, proc in self.clients:
            try:
                proc.wait(300)
            except subprocess.TimeoutExpired:
                proc.kill()
        deadline, sessions = time.time() + 60, None
        while time.time() < deadline:  # sessions the clients left open (they close within a step's timeout)
            sessions = [s["sessions"] for s in self.sample()["servers"]]
            if not any(sessions):
                break
            time.sleep(1)
        last = self.sample()
        self._append("samples.jsonl", last)
        self._stop_all()
        deadline, me = time.time() + 10, psutil.Process().pid
        while (orphans := [{"pid": pid, "role": role} for pid, (role, created) in self.seen.items()
                           if pid != me and _alive(pid, created)]) and time.time() < deadline:
            time.sleep(0.2)  # (alive 10 s after the stop: orphans)
        return {"sessions_at_end": sessions, "prefix_entries_at_end": [s["prefix_entries"] for s in last["servers"]],
                "orphans": orphans, "faults": len(self.faults),
                "fault_errors": [asdict(f) for f in self.faults if "error" in f.detail]}

    def _stop_all(self) -> None:
        for _, proc in self.clients:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        if self.gateway is not None:
            self.gateway.stop()
        for s in self.swarm.servers:  # (a SIGSTOPped server would not hear SIGTERM)
            if s.alive:
                s.proc.send_signal(signal.SIGCONT)
        self.swarm.stop()
        Partition.clear()

    def _append(self, name: str, row: dict) -> None:
        with open(self.out / name, "a") as f:
            f.write(json.dumps(row) + "\n")


def _busy_key(fault: Fault):
    return f"relay{fault.slot}" if fault.kind == "relay" else fault.slot


def _server_state(server: ServerProcess, slot: int, faulted: bool) -> dict:
    from swarmlm.wire import swarm_pb2 as pb
    from swarmlm.wire import swarm_pb2_grpc as pb_grpc
    from swarmlm.wire.channel import sync_channel

    state = {"slot": slot, "blocks": f"{_range(server).start}:{_range(server).end}", "alive": server.alive,
             "sessions": None, "prefix_entries": None, "relay": None}
    if server.alive and server.address and not faulted:  # (not a server still starting, or one faulted now)
        for address in _local_addresses(server):
            channel = sync_channel(address)
            try:
                # (with a nonce: its signed address names the relay it listens through now, behind NAT)
                info = pb_grpc.SwarmStub(channel).Info(pb.InfoRequest(nonce=os.urandom(16)), timeout=5)
                if info.server_id != server.server_id:  # (a push tunnel's port: another server answers)
                    state["error"] = "another server"
                    continue
                state.update(sessions=info.active_sessions, prefix_entries=info.prefix_cache.entries,
                             relay=info.signed_address.partition(" via ")[2] or None)
                state.pop("error", None)
                break
            except Exception as exc:
                state["error"] = type(exc).__name__
            finally:
                channel.close()
    return state


def _local_addresses(server: ServerProcess) -> list[str]:
    """Where the harness may reach a server: its address, or behind NAT the ports its main process listens on, on
    loopback (gRPC's, and the local ports of its push tunnels to relayed servers: each is asked until the server
    itself answers; its P2P daemons are its children)."""
    if not server.address.startswith("p2p/"):
        return [server.address]
    try:
        ports = sorted(c.laddr.port for c in psutil.Process(server.proc.pid).net_connections("tcp")
                       if c.status == psutil.CONN_LISTEN)
    except psutil.Error:
        return []
    return [f"127.0.0.1:{port}" for port in ports]


def _range(server: ServerProcess) -> BlockRange:
    start, end = server.args[server.args.index("--blocks") + 1].split(":")
    return BlockRange(int(start), int(end))


def _blocks(server: ServerProcess) -> set[int]:
    r = _range(server)
    return set(range(r.start, r.end))


def _alive(pid: int, created: float) -> bool:
    try:
        p = psutil.Process(pid)
        return p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
