"""How a server is reached: at its host:port, or from behind NAT through a relay (swarm/reach.py).

In a swarm (initial peers given) a server runs one P2P daemon of its own (besides its DHT node's): it asks a relay to dial its port back before it joins, listens through a relay if that failed, and
reaches relayed servers it pushes to. The dial-back reaches a plain socket on the port gRPC takes afterwards."""
from __future__ import annotations

import logging
import socket

from swarmlm.config import ServerConfig
from swarmlm.swarm.p2p_link import P2PNode, parse_relay_addr
from swarmlm.swarm.reach import Reach, RelayListener, Tunnels, check_reach
from swarmlm.wire.channel import P2P_PREFIX

log = logging.getLogger(__name__)


class ServerNetwork:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.relays = [p for p in config.initial_peers if _is_relay_addr(p)]
        self.node = P2PNode(host=config.host)
        self.tunnels = Tunnels(self.node.p2p, self.node.loop, config.swarm_key)
        self.listener: RelayListener | None = None
        self.port = config.port  # (0: gRPC picks one, unless the check below picked it)
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
        # the port gRPC will take, listened on for the dial-back and closed again before gRPC binds it
        sock = socket.create_server((cfg.host, cfg.port))
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        return self.node.run(check_reach(self.node, self.relays, sock, cfg.host, cfg.swarm_key), 60)

    @property
    def relayed(self) -> bool:
        return not self.reach.direct

    def grpc_port(self) -> int:
        """The port gRPC listens on: the one checked (or the configured one)."""
        return self.port

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
        """Relayed servers among `records` (DHT reads) become reachable for pushes."""
        for r in records:
            if r.relayed and r.relay:
                self.tunnels.add(r.address, r.relay)

    def close(self) -> None:
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

