"""The client's handle on the swarm: discovery (DHT or a fixed server list), RTT probes, routing with waits."""
from __future__ import annotations

import asyncio
import logging
import time

from swarmlm.client.router import SwarmView, choose_route
from swarmlm.client.transmission import transmission_policy
from swarmlm.client.transport import Channels, LoopThread, info
from swarmlm.config import ClientConfig
from swarmlm.errors import MissingBlocks
from swarmlm.swarm.records import ServerRecord
from swarmlm.types import Route

log = logging.getLogger(__name__)


class RemoteSequence:
    """All blocks of one model as served by the swarm."""

    def __init__(self, config: ClientConfig, num_blocks: int, prefix: str) -> None:
        self.config = config
        self.num_blocks = num_blocks
        self.prefix = prefix
        self.loop = LoopThread.get()
        self.channels = Channels(config.max_message_bytes, transmission_policy(config), config.assumed_bandwidth_bps)
        self.view = SwarmView(config)
        self.dht = None
        if config.initial_peers:
            from swarmlm.swarm.dht_thread import ThreadDHT

            # in-process, not hivemind's forked DHT: a fork beside the client's gRPC threads can hang
            self.dht = ThreadDHT(config.initial_peers, client_mode=True)

    def refresh(self) -> None:
        """Re-read who serves what, and measure the RTT to servers not measured yet."""
        if self.dht is not None:
            from swarmlm.swarm.dht import fetch_records

            records = fetch_records(self.dht, self.prefix, range(self.num_blocks))
        else:
            records = self.loop.run(self._direct_records())
        self.view.update(records)
        unmeasured = [r for sid, r in records.items() if sid not in self.view.rtt_s]
        if unmeasured:
            self.loop.run(self._measure(unmeasured))

    async def _direct_records(self) -> dict[str, ServerRecord]:
        """Without a DHT: ask each configured server for its info."""
        replies = await asyncio.gather(
            *(info(self.channels, a, self.config.connect_timeout_s) for a in self.config.servers),
            return_exceptions=True,
        )
        records: dict[str, ServerRecord] = {}
        for address, reply in zip(self.config.servers, replies):
            if isinstance(reply, BaseException):
                log.warning("server %s did not answer: %s", address, reply)
                continue
            i, rtt = reply
            records[i.server_id] = ServerRecord(
                server_id=i.server_id, address=address, start=i.start_block, end=i.end_block,
                decode_s=i.decode_s_per_block, prefill_a_s=i.prefill_a_s, prefill_b_s=i.prefill_b_s,
                cache_bytes_free=i.cache_bytes_free, cache_bytes_total=i.cache_bytes_total,
                active_sessions=i.active_sessions, queue_length=i.queue_length, max_length=i.max_length,
            )
            self.view.rtt_s[i.server_id] = rtt
        return records

    async def _measure(self, records: list[ServerRecord]) -> None:
        async def probe(r: ServerRecord) -> None:
            try:
                await info(self.channels, r.address, self.config.connect_timeout_s)  # connect + warm up
                rtts = []
                for _ in range(3):
                    _, rtt = await info(self.channels, r.address, self.config.connect_timeout_s)
                    rtts.append(rtt)
                self.view.rtt_s[r.server_id] = sorted(rtts)[1]
            except Exception as exc:
                log.warning("server %s did not answer an RTT probe: %s", r.server_id, exc)
                self.view.ban(r.server_id)

        await asyncio.gather(*(probe(r) for r in records))

    def route(self, start: int, end: int, l_in: int, l_out: int, batch: int = 1, max_length: int = 0,
              refresh: bool = False) -> Route:
        """A chain over blocks [start, end); waits up to wait_for_blocks_s for missing blocks to appear."""
        deadline = time.monotonic() + self.config.wait_for_blocks_s
        if refresh or not self.view.records:
            self.refresh()
        while True:
            try:
                return choose_route(
                    self.view, start, end, l_in, l_out, batch, max_length,
                    waiting_aware=self.config.routing == "waiting-aware",
                )
            except MissingBlocks as exc:
                if time.monotonic() >= deadline:
                    raise MissingBlocks(exc.missing, f"waited {self.config.wait_for_blocks_s:.0f} s") from None
            time.sleep(0.5)
            self.refresh()

    def close(self) -> None:
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None
