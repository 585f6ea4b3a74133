"""Byte streams over hivemind's P2P layer (the p2pd daemon shipped in its wheel): the pieces the relay
(swarm/relay.py) and its users (swarm/reach.py) share.

A stream opens with one header line (ASCII words, at most MAX_HEADER_BYTES, read within HEADER_TIMEOUT_S); after
the header both sides only copy bytes, CHUNK_BYTES at a time (far below p2pd's 4 MiB message limit, which binary
streams do not meet anyway: they are plain byte streams). Peers are hostile: a header that is too long, late or
malformed ends the stream.

`P2PNode` runs one P2P daemon on its own event loop thread (fork+exec of p2pd is safe beside gRPC threads; the same
reason the client's DHT node lives on a thread, swarm/dht_thread.py)."""
from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import re
import threading
from concurrent.futures import Future
from typing import Any, Awaitable, Sequence, TypeVar

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from swarmlm import event_loop
from swarmlm.swarm.lifetime import bind_p2pd_to_owner

T = TypeVar("T")
MAX_HEADER_BYTES = 512
HEADER_TIMEOUT_S = 5.0
CHUNK_BYTES = 64 << 10
# a relay's address as servers and records carry it: /ip4/A.B.C.D/tcp/PORT/p2p/PEER_ID
_RELAY_ADDR = re.compile(r"^/ip4/(\d{1,3}(?:\.\d{1,3}){3})/tcp/(\d{1,5})/p2p/([1-9A-HJ-NP-Za-km-z]{40,60})$")
_PEER_ID = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{40,60}$")
_WORD = re.compile(r"^[\x21-\x7e]{1,200}$")


class LinkError(ConnectionError):
    """A P2P stream that broke, or a peer that answered with an error or nonsense."""


def parse_relay_addr(text: str) -> tuple[Multiaddr, PeerID]:
    """'/ip4/A/tcp/P/p2p/ID' -> (the transport part, the peer id); ValueError if it is anything else."""
    m = _RELAY_ADDR.match(text)
    if m is None or not 0 < int(m.group(2)) < 65536:
        raise ValueError(f"not a relay address (/ip4/A.B.C.D/tcp/PORT/p2p/ID): {text[:120]!r}")
    ipaddress.IPv4Address(m.group(1))  # ValueError for 999.1.1.1
    return Multiaddr(f"/ip4/{m.group(1)}/tcp/{m.group(2)}"), PeerID.from_base58(m.group(3))


def is_peer_id(text: str) -> bool:
    if not _PEER_ID.match(text):
        return False
    try:
        PeerID.from_base58(text)
    except Exception:
        return False
    return True


def observed_ip(addr: Multiaddr) -> str | None:
    """The IPv4 address a stream's peer connected from (None for anything else, e.g. a relayed connection)."""
    text = str(addr)
    m = re.match(r"^/ip4/(\d{1,3}(?:\.\d{1,3}){3})/tcp/\d+$", text)
    return m.group(1) if m else None


def loopback_for(peer_id: str) -> str:
    """A loopback source address per remote peer (127.x.y.z), so the server's per-host limits tell relayed
    peers apart as they tell hosts apart (server/sessions.py keys quotas by the connection's host)."""
    h = hashlib.sha256(peer_id.encode()).digest()
    return f"127.{h[0]}.{h[1]}.{2 + h[2] % 250}"


# ---- header lines -------------------------------------------------------------------------------------------
def header(*words: str) -> bytes:
    line = " ".join(words).encode("ascii") + b"\n"
    assert len(line) <= MAX_HEADER_BYTES and all(_WORD.match(w) for w in words), words
    return line


async def read_header(reader: asyncio.StreamReader, timeout_s: float | None = HEADER_TIMEOUT_S) -> list[str]:
    """The peer's header words (None: waits as long as it takes); LinkError if it is late, too long, not ASCII
    words, or the stream ended."""
    try:
        async with asyncio.timeout(timeout_s):
            line = await reader.readuntil(b"\n")
    except TimeoutError:
        raise LinkError("no header in time") from None
    except asyncio.LimitOverrunError:
        raise LinkError("header too long") from None
    except asyncio.IncompleteReadError as exc:
        raise LinkError("stream ended before its header" if not exc.partial else "header cut short") from None
    if len(line) > MAX_HEADER_BYTES:
        raise LinkError("header too long")
    try:
        words = line[:-1].decode("ascii").split(" ")
    except UnicodeDecodeError:
        raise LinkError("header is not ASCII") from None
    if not all(_WORD.match(w) for w in words):
        raise LinkError("malformed header")
    return words


async def expect_ok(reader: asyncio.StreamReader, what: str) -> list[str]:
    """Read the answer header: ["OK", ...] is returned, ["ERR", reason...] raises LinkError with the reason."""
    words = await read_header(reader)
    if words[0] == "OK":
        return words[1:]
    if words[0] == "ERR":
        raise LinkError(f"{what}: " + " ".join(words[1:]).replace("_", " "))
    raise LinkError(f"{what}: unexpected answer {words[0][:20]!r}")


def reason(text: str) -> str:
    """Free text as one header word (spaces become underscores)."""
    return re.sub(r"[^\x21-\x7e]", "_", text)[:180] or "-"


# ---- copying --------------------------------------------------------------------------------------------------
async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, last: list[float]) -> None:
    loop = asyncio.get_running_loop()
    while data := await reader.read(CHUNK_BYTES):
        last[0] = loop.time()
        writer.write(data)
        await writer.drain()


async def _until_idle(last: list[float], idle_timeout_s: float) -> None:
    """Returns once no byte went either way for idle_timeout_s."""
    loop = asyncio.get_running_loop()
    while (quiet := loop.time() - last[0]) < idle_timeout_s:
        await asyncio.sleep(idle_timeout_s - quiet)


async def splice(a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                 b: tuple[asyncio.StreamReader, asyncio.StreamWriter], idle_timeout_s: float | None = None) -> None:
    """Copy both ways until either side ends or breaks (or, with `idle_timeout_s`, no byte went either way for
    that long), then close both (a reset on one side resets the other: a relayed gRPC connection that breaks
    looks broken at both ends, as a dead server's does)."""
    last = [asyncio.get_running_loop().time()]  # when a byte last went either way
    tasks = [asyncio.create_task(_pipe(a[0], b[1], last)), asyncio.create_task(_pipe(b[0], a[1], last))]
    if idle_timeout_s is not None:
        tasks.append(asyncio.create_task(_until_idle(last, idle_timeout_s)))
    await until_one_ends(tasks, (a[1], b[1]))


async def until_one_ends(tasks: list[asyncio.Task], writers) -> None:
    """Wait until one of `tasks` (a splice's directions) ends, then cancel the others and close `writers`."""
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for writer in writers:
            close(writer)


def close(writer: asyncio.StreamWriter) -> None:
    try:
        writer.close()
    except Exception:
        pass


async def open_stream(p2p: P2P, addr: str, protocol: str) -> tuple[Any, asyncio.StreamReader, asyncio.StreamWriter]:
    """A stream to the peer at relay address `addr` (connected first: hivemind has no public connect; its
    Multiaddr writes /p2p/ in a form p2pd does not parse, so the peer id goes separately)."""
    try:
        maddr, peer = parse_relay_addr(addr)
    except ValueError as exc:
        raise LinkError(str(exc)) from None
    try:
        async with asyncio.timeout(HEADER_TIMEOUT_S):
            await p2p._client.connect(peer, [maddr])
        async with asyncio.timeout(HEADER_TIMEOUT_S):
            return await p2p.call_binary_stream_handler(peer, protocol)
    except TimeoutError:
        raise LinkError(f"{addr}: no answer in {HEADER_TIMEOUT_S:.0f} s") from None
    except Exception as exc:
        raise LinkError(f"{addr}: {type(exc).__name__}: {exc}") from None


async def _cancel_all() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# ---- a daemon on a thread ---------------------------------------------------------------------------------------
class P2PNode:
    """One p2pd daemon (or a replica of another process's) driven from a daemon thread's event loop."""

    def __init__(self, host: str = "127.0.0.1", start_timeout_s: float = 30.0,
                 replicate: Multiaddr | None = None, initial_peers: Sequence[str] = ()) -> None:
        """`initial_peers`: the daemon connects to them at start (as a DHT node's does: a DHT node on this daemon,
        `ThreadDHT(replicate=...)`, reaches its initial peers through these connections)."""
        bind_p2pd_to_owner()  # (its p2pd dies with this process)
        self.loop = event_loop.new_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="swarmlm-p2p", daemon=True)
        self.thread.start()
        self.p2p: P2P | None = None
        if replicate is not None:
            create = P2P.replicate(replicate)
        else:  # no libp2p DHT, no NAT port mapping, no AutoNAT probing of others
            create = P2P.create(list(initial_peers), host_maddrs=[f"/ip4/{host}/tcp/0"], dht_mode="client",
                                auto_nat=False, nat_port_map=False, use_relay=False)
        try:
            self.p2p = self.run(create, start_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    @property
    def peer_id(self) -> str:
        return self.p2p.peer_id.to_base58()

    def submit(self, coro: Awaitable[T]) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Awaitable[T], timeout_s: float | None = None) -> T:
        return self.submit(coro).result(timeout_s)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self.loop.is_closed():
            return
        try:
            self.run(_cancel_all(), timeout_s)
        except Exception:
            pass
        if self.p2p is not None:
            p2p, self.p2p = self.p2p, None
            try:
                self.run(p2p.shutdown(), timeout_s)
            except Exception:
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout_s)
        if not self.loop.is_running():
            self.loop.close()
