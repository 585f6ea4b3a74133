"""A hivemind DHT node on a thread of this process: every swarmlm DHT node (client, server, `swarmlm dht`).

hivemind's `DHT` forks a child process; forked beside live gRPC threads (grpc warns "skipping fork()
handlers") such a child can hang before it is ready or stop answering reads, and a child outlives a SIGKILLed
parent (swarm/lifetime.py). A `DHTNode` on its own event loop needs no fork: its p2pd daemon is started by
fork+exec, which is safe, and dies with this process. The interface is the part of `hivemind.DHT` that
`swarm.dht` uses (get/store with futures, visible addresses, shutdown).

hivemind drops a peer from a node's routing table after one unanswered request (3 s) and bootstraps only once, at
start: a node whose known peers all died, restarted or stalled at once stays alone for good (a client-mode node, which
no one contacts, reads nothing more: the soak's gateway, minute 24). So while its table is empty, a node pings its
initial peers again every REJOIN_PERIOD_S."""
from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future
from typing import Any, Sequence

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.dht.validation import CompositeValidator
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from swarmlm import event_loop
from swarmlm.swarm.lifetime import bind_p2pd_to_owner
from swarmlm.swarm.validation import validators

log = logging.getLogger(__name__)

REJOIN_PERIOD_S = 5.0  # how often a node with no peer left pings its initial peers again


class ThreadDHT:
    """`hivemind.DHT`'s calls, served by a DHTNode on a daemon thread's event loop."""

    replica: P2P | None = None  # its connection to another daemon of this process (`replicate`), if any

    def __init__(self, initial_peers: Sequence[str] = (), host: str = "127.0.0.1", port: int = 0,
                 client_mode: bool = True, validator: RSASignatureValidator | None = None,
                 start_timeout_s: float = 60.0, swarm_key: bytes | None = None,
                 rejoin_period_s: float = REJOIN_PERIOD_S, identity_path: str | None = None,
                 replicate: Multiaddr | None = None) -> None:
        bind_p2pd_to_owner()  # (its p2pd dies with this process)
        self.loop = event_loop.new_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="swarmlm-dht", daemon=True)
        self.thread.start()
        self.node: DHTNode | None = None
        # A client-mode node stores nothing for others: it checks swarm-key MACs in fetch_records, not here, so a
        # record with a wrong MAC tells it the swarm is private (and does not hide the rest of that peer's answer)
        swarm_key = None if client_mode else swarm_key
        kwargs = dict(
            initial_peers=list(initial_peers), client_mode=client_mode,
            record_validator=CompositeValidator(validators(validator, swarm_key)),
            **({"identity_path": identity_path} if identity_path else {}),  # (a fixed peer id: swarmlm dht --identity)
        )

        async def create() -> DHTNode:  # on `replicate`, another P2P daemon of this process: one p2pd, not two
            if replicate is not None:
                self.replica = await P2P.replicate(replicate)
                return await DHTNode.create(p2p=self.replica, **kwargs)
            return await DHTNode.create(host_maddrs=[f"/ip4/{host}/tcp/{port}"], **kwargs)

        try:
            self.node = self._call(create()).result(start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self.initial_peers = [PeerID.from_base58(Multiaddr(a)["p2p"]) for a in initial_peers]
        self.rejoins = 0  # times the table was found empty and the initial peers pinged again
        if self.initial_peers:
            self._call(self._rejoin_when_alone(rejoin_period_s))

    def peers_known(self) -> int:
        """Peers in this node's routing table (0: it reaches no one until it rejoins)."""
        return len(self.node.protocol.routing_table.uid_to_peer_id) if self.node is not None else 0

    async def _rejoin_when_alone(self, period_s: float) -> None:
        while self.node is not None:
            await asyncio.sleep(period_s)
            node = self.node
            if node is None or self.peers_known() > 0:
                continue
            self.rejoins += 1
            log.info("DHT node alone (its peers stopped answering): pinging its %d initial peers again",
                     len(self.initial_peers))
            try:
                answered = await asyncio.gather(*(node.protocol.call_ping(p) for p in self.initial_peers))
                if any(a is not None for a in answered):  # then find our neighbours through them, as at start
                    async with asyncio.timeout(period_s * 6):
                        await node.find_nearest_nodes([node.node_id])
            except Exception as exc:  # (TimeoutError included) the next period tries again
                log.debug("rejoining the DHT: %s", exc)

    def _call(self, coro: Any) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def get(self, key: Any, latest: bool = False, return_future: bool = False) -> Any:
        future = self._call(self.node.get(key, latest=latest))
        return future if return_future else future.result()

    def store(self, key: Any, value: Any, expiration_time: float, subkey: Any = None,
              return_future: bool = False) -> Any:
        future = self._call(self.node.store(key, value, expiration_time, subkey=subkey))
        return future if return_future else future.result()

    def get_visible_maddrs(self) -> list:
        return self._call(self.node.get_visible_maddrs()).result(30)

    def daemon_maddr(self) -> Multiaddr:
        """Where its p2pd daemon takes clients (a replica P2P shares its peer id and address: the relay's)."""
        return self.node.p2p.daemon_listen_maddr

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the node (and its p2pd daemon), then the loop and its thread; safe to call twice."""
        if self.loop.is_closed():
            return
        stops = [self.node.shutdown()] if self.node is not None else []
        if self.replica is not None:  # (DHTNode leaves a P2P it was given running: its client socket goes here)
            stops.append(self.replica.shutdown())
        self.node = self.replica = None
        for coro in stops + [_cancel_all()]:  # in-flight handlers are cancelled, not destroyed with the loop
            try:
                self._call(coro).result(timeout_s)
            except Exception:
                pass  # a node that cannot stop cleanly still loses its loop below
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout_s)
        if not self.loop.is_running():
            self.loop.close()


async def _cancel_all() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
