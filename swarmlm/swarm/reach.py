"""Servers behind NAT (docs/PROTOCOL.md, "Servers behind NAT"), both ends of the relayed transport:

- `check_reach`: before it joins, a server asks a relay to dial back its port; it is direct only if the relay's
  connection arrives (the relay dials the IP it sees the server at, never an address the server names).
- `RelayListener`: an unreachable server keeps a LISTEN stream to a relay (an outgoing connection: NAT lets it
  through) and takes each circuit the relay announces, spliced onto its own gRPC port on loopback.
- `Tunnels`: a client (or a pushing server) reaches `p2p/<peer id>` addresses through a local port per server;
  each TCP connection gRPC opens there becomes one DIAL stream through the server's relay. The gRPC protocol on
  top is unchanged: same messages, auth, limits; a broken circuit is a broken connection (failover)."""
from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import dataclass

from swarmlm.swarm.p2p_link import (LinkError, P2PNode, close, expect_ok, header, loopback_for, open_stream,
                                    read_header, splice)
from swarmlm.swarm.private import make_token
from swarmlm.swarm.relay import ACCEPT_PROTO, DIAL_PROTO, DIALBACK_PROTO, LISTEN_PROTO
from swarmlm.wire.channel import P2P_PREFIX, forget_p2p_endpoint, register_p2p_endpoint

log = logging.getLogger(__name__)


def _token(swarm_key: bytes | None, proto: str) -> str:
    return make_token(swarm_key, proto) if swarm_key is not None else "-"


@dataclass(frozen=True)
class Reach:
    direct: bool
    host: str  # the host to announce when direct: the address the dial-back reached
    why: str  # one line for the log


async def check_reach(node: P2PNode, relays: list[str], sock: socket.socket, host: str,
                      swarm_key: bytes | None, wait_s: float = 1.0) -> Reach:
    """Dial-back through the first relay that answers, onto `sock` (listening on the port gRPC will take)."""
    nonce, arrived = os.urandom(16), asyncio.Event()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(2.0):
                got = await reader.readexactly(16)
            if got == nonce:
                arrived.set()
        except (asyncio.IncompleteReadError, TimeoutError, OSError):
            pass
        finally:
            close(writer)

    port = sock.getsockname()[1]
    server = await asyncio.start_server(on_connect, sock=sock)
    try:
        for relay in relays:
            try:
                _, reader, writer = await open_stream(node.p2p, relay, DIALBACK_PROTO)
                writer.write(header("DIALBACK", str(port), nonce.hex(), _token(swarm_key, DIALBACK_PROTO)))
                seen_ip = (await expect_ok(reader, f"dial-back by {relay}") or ["?"])[0]
                close(writer)
            except LinkError as exc:
                log.info("no dial-back from %s: %s", relay, exc)
                continue
            try:
                async with asyncio.timeout(wait_s):
                    await arrived.wait()
            except TimeoutError:
                return Reach(False, "", f"{seen_ip}:{port} is not reachable from outside (dial-back by {relay})")
            return Reach(True, seen_ip, f"reachable at {seen_ip}:{port} (dial-back by {relay})")
        return Reach(True, host, "no relay answered a dial-back: assuming this server is reachable")
    finally:
        server.close()


class RelayListener:
    """Keeps this server listening through one of `relays` (the first that accepts; the next on a failure)."""

    def __init__(self, node: P2PNode, relays: list[str], grpc_port: int, swarm_key: bytes | None) -> None:
        self.node, self.relays, self.grpc_port, self.swarm_key = node, list(relays), grpc_port, swarm_key
        self.relay = ""  # the relay this server is reached through now ("" = none: unreachable)
        self.why = "not started"  # why there is none
        self._circuits: set[asyncio.Task] = set()  # (held: the loop keeps only weak references to tasks)
        self._task = node.submit(self._run())

    async def _run(self) -> None:
        while True:
            failures = []
            for relay in self.relays:
                try:
                    await self._listen(relay)
                except (LinkError, ConnectionError, asyncio.IncompleteReadError) as exc:
                    failures.append(f"{relay}: {exc}")
                if self.relay:
                    log.warning("relay %s lost; trying the others", self.relay)
                    self.relay = ""
            why = "; ".join(failures) or "no relay known"
            if why != self.why:
                log.warning("no relay takes this server, it cannot be reached: %s", why)
                self.why = why
            await asyncio.sleep(1.0)

    async def _listen(self, relay: str) -> None:
        _, reader, writer = await open_stream(self.node.p2p, relay, LISTEN_PROTO)
        try:
            writer.write(header("LISTEN", _token(self.swarm_key, LISTEN_PROTO)))
            await expect_ok(reader, f"relay {relay}")
            self.relay, self.why = relay, ""
            log.info("reached through relay %s as %s%s", relay, P2P_PREFIX, self.node.peer_id)
            while True:
                words = await read_header(reader, timeout_s=None)
                if len(words) == 3 and words[0] == "CONNECT":
                    task = asyncio.create_task(self._take(relay, words[1], words[2]))
                    self._circuits.add(task)
                    task.add_done_callback(self._circuits.discard)
        finally:
            close(writer)

    async def _take(self, relay: str, cookie: str, dialer: str) -> None:
        try:
            _, reader, writer = await open_stream(self.node.p2p, relay, ACCEPT_PROTO)
            writer.write(header("ACCEPT", cookie))
            await expect_ok(reader, "accept")
            local = await asyncio.open_connection("127.0.0.1", self.grpc_port, local_addr=(loopback_for(dialer), 0))
        except (LinkError, OSError) as exc:
            log.info("a relayed connection failed: %s", exc)
            return
        await splice((reader, writer), local)

    def stop(self) -> None:
        self._task.cancel()


class Tunnels:
    """`p2p/<peer id>` -> a local port relayed to that server (registered with wire/channel.py)."""

    def __init__(self, p2p, loop: asyncio.AbstractEventLoop, swarm_key: bytes | None) -> None:
        self.p2p, self.loop, self.swarm_key = p2p, loop, swarm_key
        self.relays: dict[str, str] = {}  # p2p address -> the relay its record names
        self.ports: dict[str, int] = {}
        self.failures: dict[str, str] = {}  # p2p address -> why its last connection could not be relayed
        self._servers: list[asyncio.AbstractServer] = []
        self._starting: list = []  # (futures of the listeners being started: held until they run)

    def add(self, address: str, relay: str) -> None:
        """Route `address` through `relay` (from the server's record; a newer record may name another relay)."""
        self.relays[address] = relay
        register_p2p_endpoint(address, self.endpoint)

    def endpoint(self, address: str) -> str:
        port = self.ports.get(address)
        if port is None:
            sock = socket.create_server(("127.0.0.1", 0))  # listening now: connections queue until served
            port = self.ports[address] = sock.getsockname()[1]
            self._starting.append(asyncio.run_coroutine_threadsafe(self._serve(address, sock), self.loop))
        return f"127.0.0.1:{port}"

    async def _serve(self, address: str, sock: socket.socket) -> None:
        self._servers.append(await asyncio.start_server(
            lambda r, w: self._relay(address, r, w), sock=sock))

    async def _relay(self, address: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._via(address, self.relays.get(address, ""), reader, writer)

    async def _via(self, address: str, relay: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   tunnel: bool = True) -> None:
        peer = address[len(P2P_PREFIX):]
        try:
            _, r, w = await open_stream(self.p2p, relay, DIAL_PROTO)
            w.write(header("DIAL", peer, _token(self.swarm_key, DIAL_PROTO)))
            await expect_ok(r, f"relay {relay} to {address}")
        except (LinkError, ValueError) as exc:  # the client's call fails UNAVAILABLE: a dead server, failover
            log.warning("cannot reach %s: %s", address, exc)
            if tunnel:
                self.failures[address] = str(exc)
            close(writer)
            return
        if tunnel:
            self.failures.pop(address, None)
        await splice((reader, writer), (r, w))

    async def probe(self, address: str, relay: str) -> asyncio.AbstractServer:
        """A one-off local port (in `server.sockets`) whose connections reach `address` through `relay`, whatever
        the tunnel's relay is: a claim is checked through the relay it names without moving the tunnel (several
        claims at once). The caller closes the server (`close_probe`)."""
        sock = socket.create_server(("127.0.0.1", 0))
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(asyncio.start_server(
            lambda r, w: self._via(address, relay, r, w, tunnel=False), sock=sock), self.loop))

    def close_probe(self, server: asyncio.AbstractServer) -> None:
        self.loop.call_soon_threadsafe(server.close)

    def close(self) -> None:
        for address in self.relays:
            forget_p2p_endpoint(address, self.endpoint)
        for server in self._servers:
            self.loop.call_soon_threadsafe(server.close)
