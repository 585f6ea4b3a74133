"""How a server is reached: at its host:port, or from behind NAT through a relay (swarm/reach.py).

In a swarm (initial peers given) a server runs one P2P daemon, which its DHT node uses too (a replica: one p2pd
per server): it asks a relay to dial its port back before it joins, listens through a relay if that failed, and
reaches relayed servers it pushes to. The dial-back reaches a plain socket on the port gRPC takes afterwards.

Pushes to a relayed server go through the relay of that server's own record, never one a stranger's record names
(issue 39, hole 1, as the client's `RemoteSequence._through_relays`): a `p2p/<peer id>` address's records are claims
until one claimant passes the connect check through the relay it names (its id, its key, and that relay signed in
its Info: swarm/identity.py); that server then owns the address, and only its records move the tunnel. Claims are
checked at once, each through its own one-off port (a dead relay costs one timeout, not one per claim), and a read's
claims are chosen fairly: the claimants not tried yet first, then the longest ago, random among equals, so strangers
who claim the address (any number of them) cannot keep the real server from being tried."""
from __future__ import annotations

import asyncio
import logging
import random
import socket
import time

import grpc

from swarmlm.config import ServerConfig
from swarmlm.swarm.identity import new_nonce, signed_address, verify_info
from swarmlm.swarm.p2p_link import P2PNode, parse_relay_addr
from swarmlm.swarm.private import client_interceptors
from swarmlm.swarm.reach import Reach, RelayListener, Tunnels, check_reach
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire import swarm_pb2_grpc as pb_grpc
from swarmlm.wire.channel import P2P_PREFIX, aio_channel, is_p2p_address

log = logging.getLogger(__name__)
MAX_CLAIMS = 4  # claims of one p2p address checked at once per read (the one passing owns the address)
MAX_ADDRESSES = 4096  # p2p addresses remembered (owners and claims): beyond, forgotten rather than grown


class ServerNetwork:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.relays = [p for p in config.initial_peers if _is_relay_addr(p)]
        self.node = P2PNode(host=config.host, initial_peers=config.initial_peers)  # (the DHT node's daemon too)
        self.tunnels = Tunnels(self.node.p2p, self.node.loop, config.swarm_key)
        self.listener: RelayListener | None = None
        self.owners: dict[str, str] = {}  # p2p address -> the server id that passed the connect check through its relay
        self.claims: dict[str, dict[str, str]] = {}  # p2p address without owner -> {server id: relay} (latest read)
        self.tried: dict[tuple[str, str], float] = {}  # (p2p address, claimant) -> when its claim last failed
        self._checks: dict[str, asyncio.Task] = {}  # p2p address -> its claims being checked (one check at a time)
        self.port = config.port  # (0: gRPC picks one, unless the check below picked it)
        self._port_held: socket.socket | None = None  # the checked port, bound until gRPC takes it (grpc_port)
        try:
            self.reach = self._decide()
        except BaseException:
            self.close()
            raise
        if self.reach.direct:
            log.info("reachability: %s", self.reach.why)
        else:  # the one line an operator behind NAT needs
            log.warning("reachability: %s; serving through a relay as %s%s", self.reach.why, P2P_PREFIX,
                        self.node.peer_id)

    def _decide(self) -> Reach:
        cfg = self.config
        if cfg.reachability == "direct" or (cfg.reachability == "auto" and cfg.announce_host):
            return Reach(True, cfg.announce_host or cfg.host, "direct (as configured)")
        if cfg.reachability == "relayed":
            return Reach(False, "", "relayed (as configured)")
        # the port gRPC will take, listened on for the dial-back and held (bound) until gRPC binds it: released when
        # the check ended, a picked port was taken by another process while the blocks loaded (seen in CI under load:
        # gRPC's bind failed "Address already in use" and the server never started)
        sock = socket.create_server((cfg.host, cfg.port))
        sock.setblocking(False)
        self.port, self._port_held = sock.getsockname()[1], sock
        return self.node.run(check_reach(self.node, self.relays, sock.dup(), cfg.host, cfg.swarm_key), 60)

    @property
    def relayed(self) -> bool:
        return not self.reach.direct

    def grpc_port(self) -> int:
        """The port gRPC listens on: the one checked (released now, for gRPC to bind at once), or the configured one."""
        self._release_port()
        return self.port

    def _release_port(self) -> None:
        if self._port_held is not None:
            self._port_held.close()
            self._port_held = None

    def address(self, port: int) -> str:
        return f"{P2P_PREFIX}{self.node.peer_id}" if self.relayed else f"{self.reach.host}:{port}"

    def serve_relayed(self, local_port: int) -> None:
        """Behind NAT: take the relay's circuits onto gRPC's loopback port `local_port`."""
        self.listener = RelayListener(self.node, self.relays, local_port, self.config.swarm_key)

    @property
    def relay(self) -> str:
        """The relay this server is reached through now ("" when direct, or when no relay takes it)."""
        return self.listener.relay if self.listener is not None else ""

    def learn(self, records) -> None:
        """Relayed servers among `records` (a DHT read): an address's owner moves its tunnel to the relay its own
        record names; records of an address without owner are claims (`check_relay` tries them); a record naming
        an owned address under another id changes nothing."""
        fresh: dict[str, dict[str, str]] = {}
        for r in records:
            if not (r.relayed and r.relay):
                continue
            owner = self.owners.get(r.address)
            if owner == r.server_id:
                self.tunnels.add(r.address, r.relay)
            elif owner is None and len(claims := fresh.setdefault(r.address, {})) < MAX_ADDRESSES:
                claims[r.server_id] = r.relay
        if len(self.claims) + len(fresh) > MAX_ADDRESSES:
            self.claims.clear()
        self.claims.update({address: self._fair(address, claims) for address, claims in fresh.items()})

    def _fair(self, address: str, claims: dict[str, str]) -> dict[str, str]:
        """The `MAX_CLAIMS` of `claims` to check next: never tried first, then the longest ago, random among equals."""
        order = sorted(claims, key=lambda sid: (self.tried.get((address, sid), 0.0), random.random()))
        return {sid: claims[sid] for sid in order[:MAX_CLAIMS]}

    def may_serve(self, record) -> bool:
        """Can `record`'s server be what its address reaches (not another server's relayed address)?"""
        return not record.relayed or self.owners.get(record.address, record.server_id) == record.server_id

    async def check_relay(self, address: str) -> bool:
        """May pushes go to `address`? A direct one, yes; a relayed one once it has an owner: the claimant (of the
        latest read) that passes the connect check through the relay its record names, all claims checked at once.
        A claim that fails moves no tunnel."""
        if not is_p2p_address(address) or address in self.owners:
            return True
        check = self._checks.get(address)
        if check is None:  # (callers meanwhile wait for the same check)
            check = self._checks[address] = asyncio.ensure_future(self._check_claims(address))
            check.add_done_callback(lambda _: self._checks.pop(address, None))
        return await asyncio.shield(check)

    async def _check_claims(self, address: str) -> bool:
        claims = self.claims.pop(address, {})
        whys = await asyncio.gather(*(self._connect_check(address, sid, relay) for sid, relay in claims.items()))
        winner = None
        for (server_id, relay), why in zip(claims.items(), whys):
            if why is None and winner is None:
                winner = server_id
                self.tunnels.add(address, relay)
                if len(self.owners) >= MAX_ADDRESSES:
                    self.owners.clear()
                self.owners[address] = server_id
            elif why is not None:
                log.warning("not pushing to %s through relay %s (claimed by %s): %s", address, relay, server_id, why)
                if len(self.tried) >= MAX_ADDRESSES:
                    self.tried.clear()
                self.tried[(address, server_id)] = time.monotonic()
        return winner is not None

    async def _connect_check(self, address: str, server_id: str, relay: str) -> str | None:
        """Why the server at `address`, reached through `relay` (on a one-off port: the tunnel stays as it is), is
        not `server_id` listening there; None if it is. (`fresh`: a connection of its own, never one gRPC kept from
        an earlier check nor one in the backoff of a failed check, which answered UNAVAILABLE at once.)"""
        nonce = new_nonce()
        try:
            probe = await self.tunnels.probe(address, relay)
        except OSError as exc:
            return f"no local port to check it through ({exc})"
        host, port = probe.sockets[0].getsockname()[:2]
        channel = aio_channel(f"{host}:{port}", interceptors=client_interceptors(self.config.swarm_key), fresh=True)
        try:
            reply = await pb_grpc.SwarmStub(channel).Info(pb.InfoRequest(nonce=nonce),
                                                         timeout=self.config.push_timeout_s)
        except grpc.aio.AioRpcError as exc:
            return f"no answer ({exc.code().name})"
        finally:
            await channel.close()
            self.tunnels.close_probe(probe)
        return verify_info(reply, nonce, server_id, signed_address(address, relay))

    def close(self) -> None:
        self._release_port()
        if self.listener is not None:
            self.listener.stop()
        self.tunnels.close()
        self.node.shutdown()


def _is_relay_addr(text: str) -> bool:
    try:
        parse_relay_addr(text)
    except ValueError:
        return False
    return True

