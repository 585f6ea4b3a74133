"""The relay: a reachable swarm node (every `swarmlm dht` bootstrap, unless --no-relay) through which servers
behind NAT are reached, and which tells servers whether they are reachable at all (dial-back).

Protocols (P2P byte streams, one header line each, swarm/p2p_link.py; TOKEN is a swarm-key token in a private
swarm, "-" otherwise; every refusal is `ERR reason` and the stream is closed):

  LISTEN_PROTO   server -> relay  `LISTEN TOKEN`            -> `OK`; the stream stays open, the relay writes
                                                              `CONNECT COOKIE DIALER_PEER_ID` per new circuit
  DIAL_PROTO     client -> relay  `DIAL SERVER_PEER_ID TOKEN` -> `OK` once the server took the circuit; then bytes
  ACCEPT_PROTO   server -> relay  `ACCEPT COOKIE`           -> `OK`; then the dialer's bytes (spliced)
  DIALBACK_PROTO server -> relay  `DIALBACK PORT NONCE TOKEN` -> the relay connects to the server's observed IP
                                                              (never another: no one can aim it elsewhere) at
                                                              PORT, writes NONCE, and answers `OK SEEN_IP`

A server is known by its libp2p peer id, which p2pd authenticates: only the holder of a peer id's key can LISTEN
or ACCEPT as it. Limits (RelayLimits) bound listeners, circuits per server and in all, and waiting time. Of one
server's circuits, one dialer (peer id) holds at most max_circuits_per_dialer, and one host at most
max_circuits_per_host: peer ids are free, addresses are not; dialers the relay sees at no IPv4 address (relayed
themselves) share one such quota. A circuit with no byte either way for circuit_idle_s is closed."""
from __future__ import annotations

import asyncio
import logging
import re
import secrets
from dataclasses import dataclass

from swarmlm.swarm.p2p_link import (LinkError, P2PNode, close, header, is_peer_id, observed_ip,
                                    read_header, reason, splice)
from swarmlm.swarm.private import TokenChecker

log = logging.getLogger(__name__)
LISTEN_PROTO, DIAL_PROTO = "/swarmlm/relay-listen/1", "/swarmlm/relay-dial/1"
ACCEPT_PROTO, DIALBACK_PROTO = "/swarmlm/relay-accept/1", "/swarmlm/dialback/1"
_NONCE = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True)
class RelayLimits:
    max_listeners: int = 256  # servers relayed at once
    max_circuits_per_server: int = 16  # open relayed connections to one server (as libp2p's relays)
    max_circuits_per_dialer: int = 4  # of those, held by one dialer's peer id (a client needs 1 or 2)
    max_circuits_per_host: int = 8  # of those, held by dialers at one IPv4 address (or at none: relayed ones)
    circuit_idle_s: float = 130.0  # a circuit with no byte either way for this long is closed (past the server's
    # 120 s session idle timeout: a session's stream is never cut first; an idle gRPC channel just reconnects)
    max_circuits: int = 512  # in all
    accept_timeout_s: float = 5.0  # a server must take a circuit within this
    dialback_timeout_s: float = 2.0  # connect timeout of a dial-back
    max_dialbacks: int = 8  # dial-backs in flight

    def __post_init__(self) -> None:
        if min(self.max_listeners, self.max_circuits_per_server, self.max_circuits, self.max_dialbacks,
               self.max_circuits_per_dialer, self.max_circuits_per_host) < 1:
            raise ValueError(f"relay limits must be >= 1: {self}")
        if min(self.accept_timeout_s, self.dialback_timeout_s, self.circuit_idle_s) <= 0:
            raise ValueError(f"relay timeouts must be > 0: {self}")


class RelayService:
    """Runs on a P2PNode (a `swarmlm dht` node's daemon replica): relays circuits and answers dial-backs."""

    def __init__(self, node: P2PNode, swarm_key: bytes | None = None, limits: RelayLimits = RelayLimits(),
                 relaying: bool = True) -> None:
        self.node, self.limits, self.relaying = node, limits, relaying  # relaying=False: dial-backs only
        self.checker = TokenChecker(swarm_key) if swarm_key is not None else None
        self.listeners: dict[str, asyncio.StreamWriter] = {}  # server peer id -> its LISTEN stream
        self.circuits: dict[str, list[tuple[str, str]]] = {}  # server peer id -> (dialer, its host) per circuit
        # cookie -> (server peer id, its ACCEPT stream once taken, set when the circuit is over)
        self.pending: dict[str, tuple[str, asyncio.Future, asyncio.Event]] = {}
        self.dialbacks = asyncio.Semaphore(limits.max_dialbacks)
        self.splice = splice  # copies a circuit's bytes both ways (a hostile relay's may not: bench/tamper_relay.py)
        handlers = {LISTEN_PROTO: self._listen, DIAL_PROTO: self._dial, ACCEPT_PROTO: self._accept,
                    DIALBACK_PROTO: self._dialback}
        for proto, handler in handlers.items():
            node.run(node.p2p.add_binary_stream_handler(proto, _guarded(handler)), 30)

    def _refused(self, proto: str, token: str) -> str | None:
        if self.checker is None:
            return None
        why = self.checker.check(proto, None if token == "-" else token)
        return f"this relay belongs to a private swarm ({why})" if why else None

    async def _listen(self, info, reader, writer) -> None:
        words = await read_header(reader)
        server = info.peer_id.to_base58()
        if len(words) != 2 or words[0] != "LISTEN":
            raise LinkError("expected LISTEN TOKEN")
        if (why := self._refused(LISTEN_PROTO, words[1])) is not None:
            return _refuse(writer, why)
        if not self.relaying:
            return _refuse(writer, "this node does not relay (swarmlm dht --no-relay)")
        if server not in self.listeners and len(self.listeners) >= self.limits.max_listeners:
            return _refuse(writer, "relay full")
        old = self.listeners.get(server)
        if old is not None:
            close(old)  # a server that reconnects replaces its old stream
        self.listeners[server] = writer
        writer.write(header("OK"))
        await writer.drain()
        log.info("relaying server %s", server)
        try:  # the server sends nothing more: EOF (or a reset) = it left; a byte ends the stream (never buffered)
            if await reader.read(1):
                raise LinkError("a server sends nothing after LISTEN")
        finally:
            if self.listeners.get(server) is writer:
                del self.listeners[server]
            log.info("server %s left the relay", server)

    async def _dial(self, info, reader, writer) -> None:
        words = await read_header(reader)
        if len(words) != 3 or words[0] != "DIAL" or not is_peer_id(words[1]):
            raise LinkError("expected DIAL PEER_ID TOKEN")
        server, dialer = words[1], info.peer_id.to_base58()
        if (why := self._refused(DIAL_PROTO, words[2])) is not None:
            return _refuse(writer, why)
        control = self.listeners.get(server)
        if control is None:
            return _refuse(writer, "server not relayed here")
        circuit = (dialer, observed_ip(info.addr) or "relayed")
        if (why := circuit_refusal(self.circuits, server, circuit, self.limits)) is not None:
            return _refuse(writer, why)
        cookie = secrets.token_hex(16)
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        over = asyncio.Event()
        self.pending[cookie] = (server, accepted, over)
        self.circuits.setdefault(server, []).append(circuit)
        try:
            control.write(header("CONNECT", cookie, dialer))
            await control.drain()
            async with asyncio.timeout(self.limits.accept_timeout_s):
                theirs = await accepted
            writer.write(header("OK"))
            await writer.drain()
            await self.splice((reader, writer), theirs, self.limits.circuit_idle_s)
        except TimeoutError:
            _refuse(writer, "server did not take the connection")
        finally:
            over.set()
            self.pending.pop(cookie, None)
            self.circuits[server].remove(circuit)
            if not self.circuits[server]:
                del self.circuits[server]

    async def _accept(self, info, reader, writer) -> None:
        words = await read_header(reader)
        if len(words) != 2 or words[0] != "ACCEPT":
            raise LinkError("expected ACCEPT COOKIE")
        server, accepted, over = self.pending.get(words[1], ("", None, None))
        if accepted is None or server != info.peer_id.to_base58() or accepted.done():
            return _refuse(writer, "unknown connection")  # (a cookie only its server may take)
        writer.write(header("OK"))
        await writer.drain()
        accepted.set_result((reader, writer))
        await over.wait()  # the dialer's task copies; this stream is closed when that circuit is over

    async def _dialback(self, info, reader, writer) -> None:
        words = await read_header(reader)
        if len(words) != 4 or words[0] != "DIALBACK" or not words[1].isdigit() or not _NONCE.match(words[2]):
            raise LinkError("expected DIALBACK PORT NONCE TOKEN")
        if (why := self._refused(DIALBACK_PROTO, words[3])) is not None:
            return _refuse(writer, why)
        ip, port = observed_ip(info.addr), int(words[1])
        if ip is None or not 0 < port < 65536:
            return _refuse(writer, "no direct connection to dial back")
        async with self.dialbacks:
            try:
                async with asyncio.timeout(self.limits.dialback_timeout_s):
                    _, out = await asyncio.open_connection(ip, port)
                try:
                    out.write(bytes.fromhex(words[2]))
                    await out.drain()
                finally:  # (a failed or cancelled drain too: the socket is not left to the collector)
                    close(out)
            except (OSError, TimeoutError) as exc:
                log.debug("dial-back of %s:%d failed: %s", ip, port, exc)
        writer.write(header("OK", ip))
        await writer.drain()


def circuit_refusal(circuits: dict[str, list[tuple[str, str]]], server: str, circuit: tuple[str, str],
                    lim: RelayLimits) -> str | None:
    """Why one more circuit (dialer, host) to `server` is refused, given the circuits open now; None: admitted."""
    held = circuits.get(server, [])
    if len(held) >= lim.max_circuits_per_server or sum(map(len, circuits.values())) >= lim.max_circuits:
        return "too many relayed connections"
    if sum(dialer == circuit[0] for dialer, _ in held) >= lim.max_circuits_per_dialer:
        return "too many relayed connections from this peer"
    if sum(host == circuit[1] for _, host in held) >= lim.max_circuits_per_host:
        return "too many relayed connections from this host"
    return None


def _refuse(writer: asyncio.StreamWriter, why: str) -> None:
    try:
        writer.write(header("ERR", reason(why)))
    except Exception:
        pass


def _guarded(handler):
    """Every handler: a peer's bad input or a broken stream ends that stream, never the relay."""
    async def run(info, reader, writer) -> None:
        try:
            await handler(info, reader, writer)
        except (LinkError, ConnectionError, asyncio.IncompleteReadError) as exc:
            _refuse(writer, str(exc))
            log.debug("relay stream from %s ended: %s", info.peer_id, exc)
        except Exception:
            log.exception("relay handler failed")
        finally:
            await asyncio.sleep(0.05)  # (a last ERR line gets out before the close)
            close(writer)
    return run


def start_relay(dht, swarm_key: bytes | None = None, relaying: bool = True) -> tuple[P2PNode, RelayService]:
    """Relay and dial-back service on a running DHT node's own daemon (same peer id and address)."""
    node = P2PNode(replicate=dht.daemon_maddr())
    return node, RelayService(node, swarm_key, relaying=relaying)

