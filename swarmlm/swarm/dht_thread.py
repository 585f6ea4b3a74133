"""A hivemind DHT node on a thread of this process: every swarmlm DHT node (client, server, `swarmlm dht`).

hivemind's `DHT` forks a child process; forked beside live gRPC threads (grpc warns "skipping fork()
handlers") such a child can hang before it is ready or stop answering reads, and a child outlives a SIGKILLed
parent (swarm/lifetime.py). A `DHTNode` on its own event loop needs no fork: its p2pd daemon is started by
fork+exec, which is safe, and dies with this process. The interface is the part of `hivemind.DHT` that
`swarm.dht` uses (get/store with futures, visible addresses, shutdown)."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Any, Sequence

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.dht.validation import CompositeValidator
from hivemind.utils.multiaddr import Multiaddr

from swarmlm.swarm.lifetime import bind_p2pd_to_owner
from swarmlm.swarm.validation import validators


class ThreadDHT:
    """`hivemind.DHT`'s calls, served by a DHTNode on a daemon thread's event loop."""

    def __init__(self, initial_peers: Sequence[str] = (), host: str = "127.0.0.1", port: int = 0,
                 client_mode: bool = True, validator: RSASignatureValidator | None = None,
                 start_timeout_s: float = 60.0, swarm_key: bytes | None = None) -> None:
        bind_p2pd_to_owner()  # (its p2pd dies with this process)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="swarmlm-dht", daemon=True)
        self.thread.start()
        self.node: DHTNode | None = None
        # A client-mode node stores nothing for others: it checks swarm-key MACs in fetch_records, not here, so a
        # record with a wrong MAC tells it the swarm is private (and does not hide the rest of that peer's answer)
        swarm_key = None if client_mode else swarm_key
        create = DHTNode.create(
            initial_peers=list(initial_peers), client_mode=client_mode,
            host_maddrs=[f"/ip4/{host}/tcp/{port}"],
            record_validator=CompositeValidator(validators(validator, swarm_key)),
        )
        try:
            self.node = self._call(create).result(start_timeout_s)
        except BaseException:
            self.shutdown()
            raise

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
        self.node = None
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
