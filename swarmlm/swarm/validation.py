"""What a DHT record must be to count, checked by every swarmlm DHT node when it stores or returns one
(swarm/dht.py, swarm/dht_thread.py): hivemind's signature check, then swarmlm's rules (SwarmRecordValidator)."""
from __future__ import annotations

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarmlm.swarm.identity import id_of
from swarmlm.swarm.private import mac_ok
from swarmlm.swarm.records import MAX_CLOCK_SKEW_S, MAX_RECORD_TTL_S

OWNER = "[owner:"  # hivemind's marker of a protected (signed) subkey


def split_owner(subkey: str) -> tuple[str, bytes | None]:
    """'ID[owner:KEY]' -> ('ID', b'KEY'); (subkey, None) for an unprotected subkey."""
    owner_id, marker, rest = subkey.partition(OWNER)
    if not marker or not rest.endswith("]"):
        return subkey, None
    return owner_id, rest[:-1].encode()


class SwarmRecordValidator(RecordValidatorBase):
    """swarmlm's rules for every DHT record, on top of hivemind's signature check (which runs first and strips
    the signature): expiration within MAX_RECORD_TTL_S, the id before an owner marker is that key's id, and in a
    private swarm a valid swarm-key MAC. A node refuses to store a record that fails them, and a reader drops a
    peer's answer that contains one."""

    def __init__(self, swarm_key: bytes | None = None) -> None:
        self.swarm_key = swarm_key

    def validate(self, record: DHTRecord) -> bool:
        if record.expiration_time > get_dht_time() + MAX_RECORD_TTL_S + MAX_CLOCK_SKEW_S:
            return False
        try:
            subkey = MSGPackSerializer.loads(record.subkey) if record.subkey else None
        except Exception:
            return False
        if isinstance(subkey, str):
            owner_id, public_key = split_owner(subkey)
            if public_key is not None and id_of(public_key) != owner_id:
                return False
        if self.swarm_key is None:
            return True
        try:
            value = MSGPackSerializer.loads(record.value)
        except Exception:
            return False
        return mac_ok(self.swarm_key, subkey if isinstance(subkey, str) else "", record.expiration_time, value)

    @property
    def priority(self) -> int:
        return 5  # below RSASignatureValidator's 10: it sees the value with the signature already checked and stripped

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False


def validators(signer: RSASignatureValidator | None = None, swarm_key: bytes | None = None) -> list[RecordValidatorBase]:
    return [signer or RSASignatureValidator(), SwarmRecordValidator(swarm_key)]
