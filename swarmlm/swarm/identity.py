"""A server's identity is a key pair: its id is derived from its public key, as libp2p peer ids are.

One RSA key (the one hivemind's `RSASignatureValidator` signs DHT records with) does both jobs:
- DHT records: a record is written under the subkey `server_id + "[owner:" + public key + "]"`; the DHT checks the
  signature against the key in the subkey, and readers (`swarm.dht.fetch_records`) and every swarmlm DHT node
  (`swarm.validation.SwarmRecordValidator`) accept it only if `server_id == id_of(that key)`. A peer with its own key can
  therefore write records only under its own id: it cannot replace or hide another server's record.
- The connect check: a client sends a random nonce with `Info`; the server signs the nonce with its id, address,
  model and weights fingerprint (`sign_info`); the client checks the key hashes to the id it expected and the
  signature (`verify_info`) before it opens a session there. A record pointing at someone else's address, or a
  server answering for an id that is not its own, fails the check.

Ids: base58 of the sha2-256 multihash of the key's OpenSSH encoding, so they start with "Qm" (the shape of libp2p's
RSA peer ids, which hash a protobuf encoding of the key instead).
"""
from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import base58
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from swarmlm.wire import swarm_pb2 as pb

_MULTIHASH_SHA256 = b"\x12\x20"  # multihash header: sha2-256, 32 bytes
NONCE_BYTES = 16  # a client's challenge: random, fresh per check
MAX_NONCE_BYTES = 64  # a server signs no longer challenge
MAX_PUBLIC_KEY_BYTES = 1024  # an OpenSSH RSA-4096 key is ~730 bytes; a longer claim is refused unparsed
MAX_SIGNATURE_BYTES = 1024  # base64 of an RSA-4096 signature is 684 bytes
_INFO_DOMAIN = b"swarmlm-info-v2"  # what a signature is for: it cannot be replayed as a DHT record's signature


def id_of(public_key: bytes) -> str:
    """The server id a public key (OpenSSH bytes, as in a record's subkey) stands for."""
    return base58.b58encode(_MULTIHASH_SHA256 + hashlib.sha256(public_key).digest()).decode()  # "Qm..."


@dataclass(frozen=True)
class Identity:
    """A server's key pair and the id derived from it."""

    private_key: RSAPrivateKey

    @property
    def public_key(self) -> bytes:
        return self.private_key.get_public_key().to_bytes()

    @property
    def server_id(self) -> str:
        return id_of(self.public_key)

    @property
    def validator(self) -> RSASignatureValidator:
        """hivemind's record signer for this key (the DHT node that announces our records needs it)."""
        return RSASignatureValidator(self.private_key)

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)

    @classmethod
    def generate(cls) -> "Identity":
        return cls(RSAPrivateKey())

    @classmethod
    def load_or_create(cls, path: str | Path | None) -> "Identity":
        """The key in `path` (PEM, created with mode 0600 if absent); None = a fresh key for this process only."""
        if path is None:
            return cls.generate()
        path = Path(path)
        if not path.exists():
            identity = cls.generate()
            pem = _private_key(identity.private_key).private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
            # O_EXCL: two servers started at once with one path do not both write it
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(pem)
            return identity
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path} is not an unencrypted PEM private key: {exc}") from None
        if not isinstance(key, rsa.RSAPrivateKey):
            raise ValueError(f"{path} holds a {type(key).__name__}, swarmlm identities are RSA keys")
        wrapped = RSAPrivateKey.__new__(RSAPrivateKey)
        # hivemind's own (pickle) way to rebuild its key object from DER bytes
        wrapped.__setstate__({"_private_key": key.private_bytes(
            serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption())})
        return cls(wrapped)


def _private_key(key: RSAPrivateKey) -> rsa.RSAPrivateKey:
    return serialization.load_der_private_key(key.to_bytes(), password=None)


# ---- the connect check ---------------------------------------------------------------------------------------
def info_payload(nonce: bytes, reply: pb.InfoReply, address: str) -> bytes:
    """What a server signs in its Info reply: the client's nonce, its id, its address, model, fingerprint,
    adapters with theirs, its framed step port and its session key share (swarm/../wire/session_keys.py)
    (length-prefixed, so no two field lists give the same bytes)."""
    parts = [_INFO_DOMAIN, nonce, reply.server_id.encode(), address.encode(), reply.model.encode(),
             getattr(reply, "fingerprint", "").encode(), ",".join(reply.adapters).encode(),
             str(reply.frame_port).encode(), reply.key_share]
    return b"".join(struct.pack("!I", len(p)) + p for p in parts)


def signed_address(address: str, relay: str) -> str:
    """What a server signs as its address: a relayed one (`p2p/<peer id>`) signs the relay it is reached through
    too, so a client can require that the relay it dialed is the server's own (not one a stranger's record named)."""
    return f"{address} via {relay}" if relay else address


def sign_info(identity: Identity, reply: pb.InfoReply, nonce: bytes, address: str) -> None:
    """Answer a challenge: fill the reply's key, signed address and signature (the nonce is not echoed)."""
    if not 0 < len(nonce) <= MAX_NONCE_BYTES:
        return  # no challenge (a plain Info), or an oversized one: nothing is signed
    reply.public_key = identity.public_key
    reply.signed_address = address
    reply.signature = identity.sign(info_payload(nonce, reply, address))


def verify_info(reply: pb.InfoReply, nonce: bytes, server_id: str | None = None, address: str | None = None,
                model: str | None = None, fingerprint: str | None = None) -> str | None:
    """Why `reply` fails the connect check, or None if it passes. None arguments are not checked: `server_id` is
    the id the client expects there (from the DHT record), `address` the address that record gives."""
    if server_id is not None and reply.server_id != server_id:
        return f"answers as {reply.server_id[:60]!r}, not as the announced {server_id!r}"
    if not reply.public_key or not reply.signature:
        return "did not sign the challenge (no public key or signature in its Info reply)"
    if len(reply.public_key) > MAX_PUBLIC_KEY_BYTES or len(reply.signature) > MAX_SIGNATURE_BYTES:
        return "public key or signature too long"
    if id_of(reply.public_key) != reply.server_id:
        return f"its public key hashes to {id_of(reply.public_key)}, not to its id {reply.server_id[:60]!r}"
    if address is not None and reply.signed_address != address:
        return f"signed address {reply.signed_address[:80]!r} is not the announced {address!r}"
    if model is not None and reply.model != model:
        return f"serves model {reply.model[:80]!r}, not {model!r}"
    if fingerprint is not None and getattr(reply, "fingerprint", "") != fingerprint:
        return f"weights fingerprint {getattr(reply, 'fingerprint', '')[:80]!r} is not the expected {fingerprint!r}"
    try:
        key = RSAPublicKey.from_bytes(reply.public_key)
    except Exception as exc:  # a peer's bytes: any parse failure is a failed check
        return f"unreadable public key ({type(exc).__name__})"
    if not key.verify(info_payload(nonce, reply, reply.signed_address), reply.signature):
        return "bad signature over the challenge"
    return None


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)
