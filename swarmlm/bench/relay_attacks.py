"""Attacks on the relay (swarm/relay.py), light in tests/test_attacks.py and tests/test_fuzz_rpc.py, heavy in
benchmarks/attacks.py: every protocol gets floods, garbage and lies; the relay must stay alive and keep relaying an
honest server to an honest client (an echo behind a RelayListener, reached through Tunnels, all on loopback)."""
from __future__ import annotations

import asyncio
import os
import random
import socket
import threading
from dataclasses import dataclass

from swarmlm.swarm.p2p_link import LinkError, P2PNode, close, header, open_stream, read_header
from swarmlm.swarm.private import make_token
from swarmlm.swarm.reach import RelayListener, Tunnels
from swarmlm.swarm.relay import (ACCEPT_PROTO, DIAL_PROTO, DIALBACK_PROTO, LISTEN_PROTO, RelayLimits,
                                 RelayService)
from swarmlm.wire.channel import P2P_PREFIX

PROTOS = (LISTEN_PROTO, DIAL_PROTO, ACCEPT_PROTO, DIALBACK_PROTO)


class _Echo:
    """A TCP echo on loopback: the 'gRPC port' of the relayed server."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)


@dataclass
class RelayBed:
    """A relay, a relayed echo server and an honest client; `with RelayBed() as bed:`."""

    swarm_key: bytes | None = None
    # (on loopback every peer is at 127.0.0.1: one host, whose quota leaves the honest client room)
    limits: RelayLimits = RelayLimits(max_circuits_per_server=6, max_circuits_per_dialer=2, max_circuits_per_host=4,
                                      accept_timeout_s=2.0, circuit_idle_s=5.0)

    def __enter__(self) -> "RelayBed":
        self.nodes = [P2PNode() for _ in range(3)]  # relay, server, client
        self.relay_node, self.server_node, self.client_node = self.nodes
        self.service = RelayService(self.relay_node, self.swarm_key, self.limits)
        self.relay = str(self.relay_node.run(self.relay_node.p2p.get_visible_maddrs())[0])
        self.echo = _Echo()
        self.listener = RelayListener(self.server_node, [self.relay], self.echo.port, self.swarm_key)
        self.address = P2P_PREFIX + self.server_node.peer_id
        self.tunnels = Tunnels(self.client_node.p2p, self.client_node.loop, self.swarm_key)
        self.tunnels.add(self.address, self.relay)
        for _ in range(100):
            if self.listener.relay:
                break
            threading.Event().wait(0.1)
        return self

    def __exit__(self, *exc) -> None:
        self.tunnels.close()
        self.echo.sock.close()
        for node in self.nodes:
            node.shutdown()

    def honest_roundtrip(self, size: int = 100_000) -> bool:
        """The honest client's bytes come back through the relay unchanged."""
        host, port = self.tunnels.endpoint(self.address).split(":")
        payload = os.urandom(size)
        try:
            with socket.create_connection((host, int(port)), timeout=10) as conn:
                conn.settimeout(10)
                conn.sendall(payload)
                got = b""
                while len(got) < size and (chunk := conn.recv(1 << 16)):
                    got += chunk
            return got == payload
        except OSError:
            return False

    def attack(self, coro_fn, *args, timeout_s: float = 600.0):
        """Run an attack coroutine from a fresh attacker node (its own peer id), then stop that node."""
        attacker = P2PNode()
        try:
            return attacker.run(coro_fn(self, attacker, *args), timeout_s)
        finally:
            attacker.shutdown()


async def _answer(bed: RelayBed, node: P2PNode, proto: str, data: bytes, timeout_s: float = 8.0) -> str:
    """Send raw bytes on a fresh stream; the relay's answer ("OK ...", "ERR ..."), or "closed"."""
    try:
        _, reader, writer = await open_stream(node.p2p, bed.relay, proto)
    except LinkError as exc:
        return f"refused stream: {exc}"
    try:
        writer.write(data)
        await writer.drain()
        return " ".join(await read_header(reader, timeout_s))
    except (LinkError, ConnectionError):
        return "closed"
    finally:
        close(writer)


async def header_flood(bed: RelayBed, node: P2PNode, streams: int = 8) -> list[str]:
    """1 MiB without a newline on every protocol: each stream is closed, nothing is buffered past 512 bytes."""
    return await asyncio.gather(*(_answer(bed, node, PROTOS[i % 4], b"A" * (1 << 20)) for i in range(streams)))


async def garbage(bed: RelayBed, node: P2PNode, count: int = 40, seed: int = 0) -> list[str]:
    """Random bytes and malformed headers (wrong word counts, non-ASCII, bad ids, bad ports) on every protocol."""
    rng = random.Random(seed)
    samples = [b"\n", b"DIAL\n", b"DIAL x y z w\n", b"LISTEN a b\n", b"ACCEPT\n", b"DIALBACK 99999 00 -\n",
               b"DIALBACK 1 " + b"0" * 32 + b" - 10.0.0.1\n", "DIAL \u00e9 -\n".encode(), b"\xff\xfe\n",
               b"DIAL 12D3KooWxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx -\n"]
    sends = [(rng.choice(PROTOS), rng.choice(samples) if rng.random() < 0.6 else rng.randbytes(rng.randint(0, 600)))
             for _ in range(count)]
    answers = []
    for i in range(0, count, 32):  # 32 streams at a time (a header that never ends costs the relay's 5 s wait)
        answers += await asyncio.gather(*(_answer(bed, node, proto, data) for proto, data in sends[i:i + 32]))
    return answers


async def dial_unknown(bed: RelayBed, node: P2PNode, count: int = 8) -> list[str]:
    """DIAL peers the relay does not relay (the attacker's own id among them)."""
    ids = [node.peer_id] + [bed.relay_node.peer_id] * (count - 1)
    return [await _answer(bed, node, DIAL_PROTO, header("DIAL", i, _tok(bed, DIAL_PROTO))) for i in ids]


async def guess_cookies(bed: RelayBed, node: P2PNode, count: int = 16) -> list[str]:
    """ACCEPT with guessed cookies (and would need the server's peer id besides)."""
    return [await _answer(bed, node, ACCEPT_PROTO, header("ACCEPT", os.urandom(16).hex())) for _ in range(count)]


async def _dial(bed: RelayBed, node: P2PNode) -> tuple[str, asyncio.StreamReader, asyncio.StreamWriter | None]:
    """One DIAL to the bed's server: (the relay's answer, the stream)."""
    try:
        _, reader, writer = await open_stream(node.p2p, bed.relay, DIAL_PROTO)
        writer.write(header("DIAL", bed.address[len(P2P_PREFIX):], _tok(bed, DIAL_PROTO)))
        return " ".join(await read_header(reader)), reader, writer
    except (LinkError, ConnectionError) as exc:
        return f"closed: {exc}", None, None


async def exhaust_circuits(bed: RelayBed, node: P2PNode, extra: int = 4) -> list[str]:
    """One peer id holds as many circuits to the server as it can (max_circuits_per_server + extra tried): past
    its own quota they are refused, and while it holds them the honest client gets through (the last answer,
    "honest ok" or "honest refused"); the held ones are dropped at the end."""
    held, answers = [], []
    for _ in range(bed.limits.max_circuits_per_server + extra):
        answer, _, writer = await _dial(bed, node)
        answers.append(answer)
        held.append(writer)
    answers.append("honest ok" if await asyncio.to_thread(bed.honest_roundtrip) else "honest refused")
    for writer in filter(None, held):
        close(writer)
    await asyncio.sleep(0.5)  # (the relay notices the closes)
    return answers


async def _read_to_end(reader: asyncio.StreamReader, idle_s: float) -> None:
    """Reads (and drops) what comes until the stream ends; TimeoutError if nothing comes for `idle_s`."""
    while True:
        async with asyncio.timeout(idle_s):
            if not await reader.read(1 << 16):
                return


async def listen_flood(bed: RelayBed, node: P2PNode, size: int = 1 << 20) -> tuple[str, str]:
    """LISTEN (as itself), then `size` bytes a server never sends there: the relay must end that stream at the
    first one, not buffer them until EOF. (the relay's answer to LISTEN, "closed" or "held open")."""
    _, reader, writer = await open_stream(node.p2p, bed.relay, LISTEN_PROTO)
    try:
        writer.write(header("LISTEN", _tok(bed, LISTEN_PROTO)))
        answer = " ".join(await read_header(reader))
        chunk = b"X" * (64 << 10)
        try:
            for _ in range(max(1, size // len(chunk))):
                writer.write(chunk)
                await writer.drain()
            await _read_to_end(reader, 30.0)  # (its ERR line), then the end
        except (ConnectionError, LinkError):
            pass
        except TimeoutError:
            return answer, "held open"
        return answer, "closed"
    finally:
        close(writer)


async def idle_circuit(bed: RelayBed, node: P2PNode) -> tuple[str, str]:
    """A circuit that carries nothing: the relay closes it after circuit_idle_s (the relay's answer to the DIAL,
    then "closed" or "held open" 30 s past that)."""
    answer, reader, writer = await _dial(bed, node)
    if writer is None:
        return answer, "closed"
    try:
        await _read_to_end(reader, bed.limits.circuit_idle_s + 30.0)
        return answer, "closed"
    except TimeoutError:
        return answer, "held open"
    except ConnectionError:
        return answer, "closed"
    finally:
        close(writer)


async def aim_dialback(bed: RelayBed, node: P2PNode) -> list[str]:
    """Ask the relay to dial somewhere else: there is no field for a host; extra words are refused."""
    nonce = os.urandom(16).hex()
    return [await _answer(bed, node, DIALBACK_PROTO, header("DIALBACK", "9", nonce, _tok(bed, DIALBACK_PROTO),
                                                           "10.0.0.1")),
            await _answer(bed, node, DIALBACK_PROTO, header("DIALBACK", "0", nonce, _tok(bed, DIALBACK_PROTO)))]


async def tokens_without_key(bed: RelayBed, node: P2PNode) -> list[str]:
    """In a private swarm: no token, a wrong key's token, a replayed token, on every protocol that takes one."""
    peer = bed.address[len(P2P_PREFIX):]
    wrong = make_token(b"w" * 32, DIAL_PROTO)
    replay = make_token(bed.swarm_key, DIAL_PROTO) if bed.swarm_key else "-"
    answers = [await _answer(bed, node, DIAL_PROTO, header("DIAL", peer, t)) for t in ("-", wrong, replay, replay)]
    answers.append(await _answer(bed, node, LISTEN_PROTO, header("LISTEN", "-")))
    answers.append(await _answer(bed, node, DIALBACK_PROTO, header("DIALBACK", "9", os.urandom(16).hex(), "-")))
    return answers


def _tok(bed: RelayBed, proto: str) -> str:
    return make_token(bed.swarm_key, proto) if bed.swarm_key else "-"


# ---- a stranger's record naming a relayed server (issue 39, hole 1): needs a swarm, not the bed ----------------
def record_hijack(swarm, server, ids, new_tokens: int, clients: int = 2) -> list[dict]:
    """A stranger with a fresh key of its own publishes (every second) a copy of a relayed `server`'s record under
    its own id, naming a dead relay; `clients` new clients of `swarm` (a LocalSwarm) then generate greedily, and
    each reads the two records in both orders. Per client: its tokens, the relay its tunnel uses after the reads
    (`relay_after_reads`: one per order), the address's owner, and the server's own relay."""
    import dataclasses

    from swarmlm.client.model import DistributedModelForCausalLM
    from swarmlm.swarm.dht import announce, default_dht_prefix, fetch_records, owner_subkey
    from swarmlm.swarm.dht_thread import ThreadDHT
    from swarmlm.swarm.identity import Identity

    dht_prefix = default_dht_prefix(swarm.model_dir)
    key = Identity.generate()
    signer, stranger = key.validator, key.server_id
    attacker = ThreadDHT(swarm.initial_peers, client_mode=False, validator=signer)
    stop, out = threading.Event(), []
    try:
        honest = _record_with_relay(attacker, dht_prefix, server.server_id, stop)
        lie = dataclasses.replace(honest, server_id=stranger,
                                  relay=f"/ip4/127.0.0.1/tcp/9/p2p/{honest.relay.split('/')[-1]}")  # dead port

        def publish() -> None:
            while not stop.is_set():
                announce(attacker, dht_prefix, lie, 8.0, subkey=owner_subkey(stranger, signer))
                stop.wait(1.0)

        threading.Thread(target=publish, daemon=True).start()
        for _ in range(150):  # (its record readable: then the clients come)
            if stranger in fetch_records(attacker, dht_prefix, [honest.start]) or stop.wait(0.2):
                break
        else:
            raise RuntimeError("the stranger's record was not stored")
        for _ in range(clients):
            client = DistributedModelForCausalLM.from_pretrained(swarm.model_dir, initial_peers=swarm.initial_peers)
            try:
                got = client.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
                remote, after = client.remote, []
                for order in ((honest, lie), (lie, honest)):  # whichever record a read lists last
                    remote._through_relays({r.server_id: r for r in order})
                    after.append(remote.tunnels.relays[server.address])
                out.append({"tokens": got[0, ids.shape[1]:].tolist(), "relay_after_reads": after,
                            "owner": getattr(remote, "p2p_owners", {}).get(server.address), "own_relay": honest.relay})
            finally:
                client.close()
    finally:
        stop.set()
        attacker.shutdown()
    return out


def _record_with_relay(dht, dht_prefix: str, server_id: str, stop: threading.Event, tries: int = 100, block: int = 0):
    """The server's record (under `block`) once it names its relay."""
    from swarmlm.swarm.dht import fetch_records

    for _ in range(tries):
        record = fetch_records(dht, dht_prefix, [block]).get(server_id)
        if record is not None and record.relay:
            return record
        stop.wait(0.2)
    raise RuntimeError(f"server {server_id} announced no relay")
