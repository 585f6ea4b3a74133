"""Swarm membership on hivemind's DHT: servers announce one small record per block; clients read them."""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Iterable, Sequence

import hivemind
from hivemind.utils import get_dht_time

from swarmlm.swarm.records import OFFLINE, ServerRecord, block_key

log = logging.getLogger(__name__)


def default_prefix(model_dir: str | Path) -> str:
    """DHT namespace from the checkpoint directory's name (servers and clients of one model agree on it)."""
    name = Path(model_dir).resolve().name
    return re.sub(r"[^A-Za-z0-9_-]", "-", name) or "model"


def start_dht(
    initial_peers: Sequence[str] = (), host: str = "127.0.0.1", port: int = 0, client_mode: bool = False
) -> hivemind.DHT:
    return hivemind.DHT(
        initial_peers=list(initial_peers),
        host_maddrs=[f"/ip4/{host}/tcp/{port}"],
        client_mode=client_mode,
        start=True,
        # a bootstrap node that is not reachable yet should not hang us forever
        await_ready=True,
    )


def visible_addrs(dht: hivemind.DHT) -> list[str]:
    return [str(a) for a in dht.get_visible_maddrs()]


def announce(dht: hivemind.DHT, prefix: str, record: ServerRecord, ttl_s: float, timeout_s: float = 10.0) -> None:
    """Store the record under every block it serves; wait until all stores have been sent."""
    expiration = get_dht_time() + ttl_s
    futures = [
        dht.store(block_key(prefix, b), record.to_dict(), expiration_time=expiration, subkey=record.server_id,
                  return_future=True)
        for b in range(record.start, record.end)
    ]
    for f in futures:
        f.result(timeout=timeout_s)


def fetch_records(
    dht: hivemind.DHT, prefix: str, blocks: Iterable[int], timeout_s: float = 10.0
) -> dict[str, ServerRecord]:
    """Online servers with a valid, unexpired record on any of `blocks`, by server id (newest record wins)."""
    futures = {b: dht.get(block_key(prefix, b), latest=True, return_future=True) for b in blocks}
    found: dict[str, tuple[float, ServerRecord]] = {}
    now = get_dht_time()
    for block, future in futures.items():
        try:
            entry = future.result(timeout=timeout_s)
        except Exception as exc:  # a slow or broken DHT read is a missing block, not a crash
            log.warning("DHT read of block %d failed: %s", block, exc)
            continue
        if entry is None or not isinstance(entry.value, dict):
            continue
        for subkey, item in entry.value.items():
            try:
                record = ServerRecord.from_dict(item.value)
            except ValueError as exc:
                log.debug("dropped a malformed record under block %d: %s", block, exc)
                continue
            if item.expiration_time < now or record.server_id != subkey or not record.start <= block < record.end:
                continue
            prev = found.get(record.server_id)
            if prev is None or item.expiration_time > prev[0]:
                found[record.server_id] = (item.expiration_time, record)
    return {sid: rec for sid, (_, rec) in found.items() if rec.state != OFFLINE}
