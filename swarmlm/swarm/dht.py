"""Swarm membership on hivemind's DHT: servers announce one small record per block; clients read them."""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Iterable, Sequence

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time

from swarmlm.swarm.dht_thread import ThreadDHT
from swarmlm.swarm.records import OFFLINE, ServerRecord, block_key

log = logging.getLogger(__name__)

# a server's forked DHT process, or a client's in-process node: the same calls
AnyDHT = hivemind.DHT | ThreadDHT


def default_prefix(model_dir: str | Path) -> str:
    """DHT namespace from the checkpoint directory's name (servers and clients of one model agree on it)."""
    name = Path(model_dir).resolve().name
    return re.sub(r"[^A-Za-z0-9_-]", "-", name) or "model"


OWNER = "[owner:"  # hivemind's marker of a protected (signed) subkey


def start_dht(
    initial_peers: Sequence[str] = (), host: str = "127.0.0.1", port: int = 0, client_mode: bool = False,
    validator: RSASignatureValidator | None = None,
) -> hivemind.DHT:
    """A DHT node that signs the records it owns and rejects records whose signature does not match."""
    return hivemind.DHT(
        initial_peers=list(initial_peers),
        host_maddrs=[f"/ip4/{host}/tcp/{port}"],
        client_mode=client_mode,
        start=True,
        await_ready=True,
        record_validators=[validator or RSASignatureValidator()],
    )


def owner_subkey(server_id: str, validator: RSASignatureValidator | None = None) -> str:
    """The subkey a server writes under: its id plus its public key, so only its key can sign that record."""
    return server_id + (validator or RSASignatureValidator()).local_public_key.decode()


def visible_addrs(dht: AnyDHT) -> list[str]:
    return [str(a) for a in dht.get_visible_maddrs()]


def announce(dht: AnyDHT, prefix: str, record: ServerRecord, ttl_s: float, timeout_s: float = 10.0,
             subkey: str | None = None) -> bool:
    """Store the (signed) record under every block it serves; True if every store was accepted."""
    expiration = get_dht_time() + ttl_s
    subkey = subkey or owner_subkey(record.server_id)
    futures = [
        dht.store(block_key(prefix, b), record.to_dict(), expiration_time=expiration, subkey=subkey,
                  return_future=True)
        for b in range(record.start, record.end)
    ]
    return all(bool(f.result(timeout=timeout_s)) for f in futures)


def fetch_records(
    dht: AnyDHT, prefix: str, blocks: Iterable[int], timeout_s: float = 10.0
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
            # only signed records count: the DHT checked the signature against the key in the subkey
            owner_id, marker, _ = str(subkey).partition(OWNER)
            if not marker:
                log.debug("dropped an unsigned record under block %d", block)
                continue
            try:
                record = ServerRecord.from_dict(item.value)
            except ValueError as exc:
                log.debug("dropped a malformed record under block %d: %s", block, exc)
                continue
            if item.expiration_time < now or record.server_id != owner_id or not record.start <= block < record.end:
                continue
            prev = found.get(record.server_id)
            if prev is None or item.expiration_time > prev[0]:
                found[record.server_id] = (item.expiration_time, record)
    return {sid: rec for sid, (_, rec) in found.items() if rec.state != OFFLINE}
