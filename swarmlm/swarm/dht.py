"""Swarm membership on hivemind's DHT: servers announce one small record per block; clients read them.

What a record must be to count (checked by every swarmlm DHT node when it stores or returns one, and again by
`fetch_records`): signed by the key in its subkey (hivemind's RSASignatureValidator), under the id that key hashes to
(swarm/identity.py), expiring at most MAX_RECORD_TTL_S ahead, and in a private swarm carrying a valid swarm-key MAC
(swarm/private.py). A peer can thus add records under its own id only; whether such a server is any good is the
client's connect check. The record rules themselves: swarm/validation.py."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable, Sequence

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr

from swarmlm.swarm.dht_thread import ThreadDHT
from swarmlm.swarm.identity import id_of
from swarmlm.swarm.private import MAC_FIELD, mac_ok, refuse_keyless, with_mac
from swarmlm.swarm.records import (
    JOINING, LOADING, MAX_CLOCK_SKEW_S, MAX_RECORD_TTL_S, ONLINE, ServerRecord, block_key,
)
from swarmlm.swarm.validation import split_owner

log = logging.getLogger(__name__)

# hivemind's forked DHT process (no longer started by swarmlm: swarm/lifetime.py), or our in-process node
AnyDHT = hivemind.DHT | ThreadDHT


def default_dht_prefix(model_dir: str | Path) -> str:
    """DHT namespace from the model's identity (hub id, or a hash of a directory's config.json): servers and
    clients of one model agree on it whatever the path (swarmlm/model/fingerprint.py)."""
    from swarmlm.model.fingerprint import dht_prefix

    return dht_prefix(model_dir)


def start_dht(
    initial_peers: Sequence[str] = (), host: str = "127.0.0.1", port: int = 0, client_mode: bool = False,
    validator: RSASignatureValidator | None = None, swarm_key: bytes | None = None, identity_path: str | None = None,
    replicate: Multiaddr | None = None,
) -> ThreadDHT:
    """A DHT node that signs the records it owns and refuses records that break swarmlm's rules (see above); it
    runs in this process (no forked child to outlive it) and its p2pd dies with it (swarm/lifetime.py).
    `identity_path`: its P2P key file (created if missing; None: a fresh key, a new peer id each start).
    `replicate`: the daemon address of a P2P daemon this process runs already: the node uses it (its peer id and
    addresses) instead of starting its own p2pd."""
    return ThreadDHT(initial_peers, host=host, port=port, client_mode=client_mode, validator=validator,
                     swarm_key=swarm_key, identity_path=identity_path, replicate=replicate)


def owner_subkey(server_id: str, validator: RSASignatureValidator | None = None) -> str:
    """The subkey a server writes under: its id plus its public key, so only its key can sign that record."""
    return server_id + (validator or RSASignatureValidator()).local_public_key.decode()


def visible_addrs(dht: AnyDHT) -> list[str]:
    return [str(a) for a in dht.get_visible_maddrs()]


def announce(dht: AnyDHT, dht_prefix: str, record: ServerRecord, ttl_s: float, timeout_s: float = 10.0,
                 subkey: str | None = None, swarm_key: bytes | None = None) -> bool:
    """Store the (signed) record under every block it serves; True if every store was accepted."""
    if not 0 < ttl_s <= MAX_RECORD_TTL_S:
        raise ValueError(f"record ttl must be in (0, {MAX_RECORD_TTL_S}] s, got {ttl_s}")
    expiration = get_dht_time() + ttl_s
    subkey = subkey or owner_subkey(record.server_id)
    value = with_mac(swarm_key, subkey, expiration, record.to_dict())
    futures = [
        dht.store(block_key(dht_prefix, b), value, expiration_time=expiration, subkey=subkey,
                  return_future=True)
        for b in range(record.start, record.end)
    ]
    return all(bool(f.result(timeout=timeout_s)) for f in futures)


def fetch_records(
    dht: AnyDHT, dht_prefix: str, blocks: Iterable[int], timeout_s: float = 10.0, swarm_key: bytes | None = None,
    joining: bool = False,
) -> dict[str, ServerRecord]:
    """Online servers with a valid, unexpired record on any of `blocks`, by server id (newest record wins); with
    `joining`, servers that are still joining or loading too (for placement: nothing is routed to them).

    A record counts only if its subkey's key hashes to its id and its expiration is within MAX_RECORD_TTL_S (the DHT
    checked the signature by that key); with `swarm_key`, only if its MAC is valid too. Without a key, records
    carrying a MAC mean the swarm is private: SwarmAccessDenied."""
    futures = {b: dht.get(block_key(dht_prefix, b), latest=True, return_future=True) for b in blocks}
    found: dict[str, tuple[float, ServerRecord]] = {}
    refused = ""  # records we cannot read: the swarm is private and we lack (the right) key
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
            why = _why_dropped(str(subkey), item.value, item.expiration_time, block, now, swarm_key)
            if why is not None:
                refused = why if why.startswith(("private", "wrong")) else refused
                log.debug("dropped a record under block %d: %s", block, why)
                continue
            record = ServerRecord.from_dict(item.value)
            prev = found.get(record.server_id)
            if prev is None or item.expiration_time > prev[0]:
                found[record.server_id] = (item.expiration_time, record)
    if refused and not found:
        raise refuse_keyless(f"the DHT namespace {dht_prefix!r}" + (" (our swarm key is not its key)"
                                                                    if refused.startswith("wrong") else ""))
    wanted = (ONLINE, JOINING, LOADING) if joining else (ONLINE,)
    return {sid: rec for sid, (_, rec) in found.items() if rec.state in wanted}


def _why_dropped(subkey: str, value, expiration_time: float, block: int, now: float,
                 swarm_key: bytes | None) -> str | None:
    """Why a record does not count, or None. "private...": it carries a swarm-key MAC and we have no key;
    "wrong...": its MAC does not verify with our key."""
    owner_id, public_key = split_owner(subkey)
    if public_key is None:
        return "unsigned"
    if id_of(public_key) != owner_id:
        return "its id is not its key's"
    if not now <= expiration_time <= now + MAX_RECORD_TTL_S + MAX_CLOCK_SKEW_S:
        return "expired or expiring too far ahead"
    if swarm_key is None and isinstance(value, dict) and MAC_FIELD in value:
        return "private"
    if swarm_key is not None and not mac_ok(swarm_key, subkey, expiration_time, value):
        return "wrong swarm-key MAC" if isinstance(value, dict) and MAC_FIELD in value else "no swarm-key MAC"
    try:
        record = ServerRecord.from_dict(value)
    except ValueError as exc:
        return f"malformed: {exc}"
    if record.server_id != owner_id:
        return "written under another id"
    if not record.start <= block < record.end:
        return "outside its range"
    return None
