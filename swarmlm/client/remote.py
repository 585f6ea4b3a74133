"""The client's handle on the swarm: discovery (DHT or a fixed server list), RTT probes, routing (client/router.py:
the planner's WS-RR fed from what this client sees), and waiting for missing blocks."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Callable

import grpc

from swarmlm.client.router import LiveRouter, SwarmView
from swarmlm.client.channels import Channels, LoopThread, info
from swarmlm.config import ClientConfig
from swarmlm.errors import MissingBlocks, SwarmAccessDenied, block_ranges
from swarmlm.swarm.identity import new_nonce, signed_address, verify_info
from swarmlm.swarm.private import client_interceptors
from swarmlm.swarm.records import LOADING, ONLINE, ServerRecord, of_our_protocol, record_from_info
from swarmlm.types import Route, Span
from swarmlm.wire.protocol import protocol_refusal

log = logging.getLogger(__name__)


class RemoteSequence:
    """All blocks of one model as served by the swarm."""

    def __init__(self, config: ClientConfig, num_blocks: int, dht_prefix: str,
                 share: "RemoteSequence | None" = None) -> None:
        """`share`: another view of the same swarm (sibling()) whose DHT node, relays and verdicts this one uses."""
        self.config = config
        self.num_blocks = num_blocks
        self.dht_prefix = dht_prefix
        self.loop = LoopThread.get()
        self.channels = Channels(config, interceptors=client_interceptors(config.swarm_key))
        # (server id, address) pairs that failed the connect check (swarm/identity.py), or announce another wire
        # protocol (wire/protocol.py) or other weights -> why: never routed to
        self.rejected: dict[tuple[str, str], str] = share.rejected if share else {}
        # servers of the last read that are refused, by id -> (record, why): named when blocks end up missing
        self.refused: dict[str, tuple[ServerRecord, str]] = {}
        # p2p/<peer id> -> the server id that passed the connect check there, through the relay dialed: only that
        # server's own records set or change the relay of that address (a stranger's record naming it changes none)
        self.p2p_owners: dict[str, str] = share.p2p_owners if share else {}
        # (start, end, announced fingerprint) -> why refused or None; set by the client model from its checkpoint
        self.weights_check: Callable[[int, int, str], str | None] | None = share.weights_check if share else None
        self.view = SwarmView(config)
        self.unreachable: dict[str, str] = {}  # --servers addresses that did not answer -> why (for the error)
        # servers of our wire protocol announcing blocks they are loading (never routed to; waited for)
        self.loading: dict[str, ServerRecord] = {}
        # servers whose failure was logged once at WARNING (again: at DEBUG)
        self.reported: set[str] = share.reported if share else set()
        self.router = LiveRouter(self.view, num_blocks)
        self.owner = share is None  # close() shuts the DHT node and relays down only in the view that made them
        self.dht = self.tunnels = None
        if share is not None:
            self.dht, self.tunnels = share.dht, share.tunnels
            return
        if config.initial_peers:
            from swarmlm.swarm.dht_thread import ThreadDHT

            # in-process, not hivemind's forked DHT: a fork beside the client's gRPC threads can hang
            self.dht = ThreadDHT(config.initial_peers, client_mode=True, swarm_key=config.swarm_key)
        # servers behind NAT, through their relays, on the DHT node's P2P daemon (swarm/reach.py)
        if self.dht is not None:
            from swarmlm.swarm.reach import Tunnels

            self.tunnels = Tunnels(self.dht.node.p2p, self.dht.loop, config.swarm_key)

    def refresh(self) -> None:
        """Re-read who serves what, and measure the RTT to servers not measured yet."""
        if self.dht is not None:
            from swarmlm.swarm.dht import fetch_records

            records = fetch_records(self.dht, self.dht_prefix, range(self.num_blocks), swarm_key=self.config.swarm_key,
                                    joining=True)
            self.loading = of_our_protocol({sid: r for sid, r in records.items() if r.state == LOADING})
            records = self._through_relays(self._without_refused({sid: r for sid, r in records.items()
                                                                  if r.state == ONLINE}))
        else:
            records = self._without_refused(self.loop.run(self._direct_records()))
        unmeasured = [r for sid, r in records.items() if sid not in self.view.rtt_s]
        if unmeasured:  # measured (and checked) before they enter the view: an impostor is never routed to
            self.loop.run(self._measure(unmeasured))
        self.view.update({sid: r for sid, r in records.items() if (sid, r.address) not in self.rejected})
        self.channels.adapter = self.view.adapter  # (sessions open with the adapter's one version)

    def _through_relays(self, records: dict[str, ServerRecord]) -> dict[str, ServerRecord]:
        """Servers behind NAT are reached through the relay their record names; one that no relay takes cannot be
        reached at all: left out, and named with the reason if blocks end up missing.

        A relayed address's relay comes only from the record of the server that passed the connect check there;
        until one has, from one claimant per read (a banned one waits: a stranger's dead relay does not shut out
        the server whose address it names)."""
        usable, claimed, banned = {}, set(), self.view.banned()
        for sid, r in records.items():
            if r.relayed and not r.relay:
                self.unreachable[f"{sid} ({r.address})"] = "behind NAT and no relay takes it"
                continue
            if r.relayed:
                owner = self.p2p_owners.get(r.address)
                if owner not in (None, sid) or (owner is None and (r.address in claimed or sid in banned)):
                    continue  # (another server's address, or a claim that waits its turn)
                claimed.add(r.address)
                self.tunnels.add(r.address, r.relay)
            self.unreachable.pop(f"{sid} ({r.address})", None)
            usable[sid] = r
        return usable

    def _without_refused(self, records: dict[str, ServerRecord]) -> dict[str, ServerRecord]:
        """`records` but the servers this client must not use (kept in `refused`, with why): another wire protocol,
        other weights under this model's name, or a failed connect check earlier."""
        for sid, r in records.items():
            if (sid, r.address) not in self.rejected and (why := self._why_refused(r)):
                log.warning("server %s at %s is refused: %s", sid, r.address, why)
                self._reject(r, why)
        self.refused = {sid: (r, self.rejected[(sid, r.address)]) for sid, r in records.items()
                        if (sid, r.address) in self.rejected}
        return {sid: r for sid, r in records.items() if sid not in self.refused}

    def _why_refused(self, r: ServerRecord) -> str | None:
        """Another wire protocol first (its fingerprints and messages may not mean ours), then other weights
        (model/fingerprint.py; set by the client model from its checkpoint)."""
        return protocol_refusal(r.protocol) or \
            (self.weights_check(r.start, r.end, r.fingerprint) if self.weights_check is not None else None)

    def _reject(self, r: ServerRecord, why: str) -> None:
        if len(self.rejected) > 4096:  # bounded: forget old verdicts rather than grow (peers choose their records)
            self.rejected.clear()
        self.rejected[(r.server_id, r.address)] = why

    async def _direct_records(self) -> dict[str, ServerRecord]:
        """Without a DHT: ask each configured server for its info."""
        nonce = new_nonce()
        replies = await asyncio.gather(
            *(info(self.channels, a, self.config.connect_timeout_s, nonce) for a in self.config.servers),
            return_exceptions=True,
        )
        records: dict[str, ServerRecord] = {}
        for address, reply in zip(self.config.servers, replies):
            if isinstance(reply, BaseException):
                _raise_if_private(address, reply)
                self.unreachable[address] = _why_unreachable(reply)
                report_failure(self.reported, address, f"server {address} did not answer: {self.unreachable[address]}",
                                reply)
                continue
            self.unreachable.pop(address, None)
            self.reported.discard(address)
            i, _ = reply
            why = verify_info(i, nonce)  # its id is its key's, and it holds that key
            if why is not None:
                log.warning("server %s fails the connect check, excluded: %s", address, why)
                continue
            try:
                records[i.server_id] = record_from_info(i, address)
            except ValueError as exc:
                log.warning("server %s sent a malformed Info: %s", address, exc)
                continue
            self.channels.note_info(address, i)  # (its framed port: signed with the rest)
        return records

    async def _measure(self, records: list[ServerRecord]) -> None:
        async def probe(r: ServerRecord) -> None:
            try:
                # connect + warm up + the connect check: the server proves it holds the key of the id it was
                # announced with, at the address announced (a record pointing elsewhere fails)
                nonce = new_nonce()
                reply, _ = await info(self.channels, r.address, self.config.connect_timeout_s, nonce)
                # (and signs the weights fingerprint its record announces, which weights_check accepted)
                # a fixed server list names addresses the user chose (a relay or NAT may stand in front of the
                # server): the id is the server's own there, so only a DHT record's address is checked
                # (a relayed one signs the relay it is at, which must be the relay we dialed)
                dialed = self.tunnels.relays.get(r.address, "") if r.relayed else ""
                signed = signed_address(r.address, dialed) if self.dht is not None else None
                why = verify_info(reply, nonce, r.server_id, signed, fingerprint=r.fingerprint or None)
                if why is None and ",".join(reply.adapters) != r.adapters:  # (signed: name@fingerprint each)
                    why = f"its Info's adapters {list(reply.adapters)[:4]} are not its record's"
                if why is not None and r.relayed and reply.server_id == r.server_id:
                    raise ConnectionError(f"reached through another relay than its own: {why}")  # (banned, retried)
                if why is not None:
                    log.warning("server %s at %s fails the connect check, excluded: %s", r.server_id, r.address, why)
                    self._reject(r, why)
                    self.view.ban(r.server_id)
                    return
                self.channels.note_info(r.address, reply)  # (its framed port: signed with the rest)
                rtts = []
                for _ in range(3):
                    _, rtt = await info(self.channels, r.address, self.config.connect_timeout_s)
                    rtts.append(rtt)
                # the least of the probes: a busy host only adds delay (event loops, scheduling), and the route
                # cost weighs the RTT l_out times, so a probe's noise would otherwise choose the replica
                self.view.rtt_s[r.server_id] = min(rtts)
                if r.relayed:
                    if len(self.p2p_owners) > 4096:
                        self.p2p_owners.clear()
                    self.p2p_owners[r.address] = r.server_id
                if not getattr(self.view.bans.get(r.server_id), "tampered", False):  # (a check does not pass
                    self.view.bans.pop(r.server_id, None)  # what changed its messages) it answers again (a
                    # restarted server): route to it at once
                self.reported.discard(r.server_id)
            except Exception as exc:
                if _is_unauthenticated(exc):
                    denied.append((r.address, exc))
                if r.relayed:  # (a dead relay, or one that does not take us: the error says so)
                    why = self.tunnels.failures.get(r.address) or _why_unreachable(exc)
                    self.unreachable[f"{r.server_id} ({r.address})"] = f"behind NAT, through its relay: {why}"
                report_failure(self.reported, r.server_id, f"server {r.server_id[-8:]} at {r.address} does not "
                                f"answer ({_why_unreachable(exc)}): routing around it", exc)
                self.view.ban(r.server_id)

        denied: list[tuple[str, BaseException]] = []
        await asyncio.gather(*(probe(r) for r in records))
        if denied and len(denied) == len(records):  # a private swarm and we lack its key: nothing will work
            _raise_if_private(*denied[0])

    def route(self, start: int, end: int, l_in: int, l_out: int, batch: int = 1, max_length: int = 0,
              refresh: bool = False, prefix_held=None) -> Route:
        """A chain over blocks [start, end); waits up to wait_for_blocks_s for missing blocks to appear, and up to
        wait_for_loading_s in all while servers announce every missing block as loading. The swarm is read again
        first if asked, or if the last read is older than records_max_age_s (load changes)."""
        cfg = self.config
        t0 = time.monotonic()
        if refresh or not self.view.records or time.monotonic() - self.view.read_s > self.config.records_max_age_s:
            self.refresh()
        missing, told_loading = None, False
        while True:
            try:
                return self.router.route(start, end, l_in, l_out, batch, max_length, prefix_held)
            except MissingBlocks as exc:
                if missing is None and time.monotonic() < t0 + cfg.wait_for_blocks_s:  # one line: what, how long
                    log.warning("%s: waiting up to %.0f s for a server to take them (a server with room in its "
                                "--memory-mb moves onto them)", exc, cfg.wait_for_blocks_s)
                missing = exc.missing
                loaders = self._loading(missing)
                if loaders and not told_loading and cfg.wait_for_loading_s > cfg.wait_for_blocks_s:
                    told_loading = True  # (one more line, once: the wait grows while they load)
                    log.warning("server %s announces blocks %s as loading: waiting for it up to %.0f s in all",
                                ", ".join(sid[-8:] for sid in loaders), block_ranges(missing), cfg.wait_for_loading_s)
                limit_s = max(cfg.wait_for_loading_s if loaders else 0.0, cfg.wait_for_blocks_s)
                if time.monotonic() >= t0 + limit_s:
                    down = ", ".join(f"{a} ({why})" for a, why in self.unreachable.items())  # "refused" vs nobody
                    refused = "; ".join(f"server {sid} at {r.address} is refused: {why}" for sid, (r, why)
                                        in self.refused.items() if any(r.start <= b < r.end for b in exc.missing))
                    adapter = self.config.active_adapter
                    raise MissingBlocks(exc.missing, f"waited {limit_s:.0f} s"
                                        + (f"; loading on {', '.join(sid[-8:] for sid in loaders)}" if loaders else "")
                                        + (f"; unreachable: {down}" if down else "")
                                        + (f"; {refused}" if refused else "")
                                        + (f"; with adapter {adapter!r}: servers pre-load it with --adapters DIR"
                                           if adapter else "")) from None
            time.sleep(0.5)
            self.refresh()
            self._recheck_banned(missing)

    def _loading(self, missing) -> list[str]:
        """Servers announcing missing blocks as loading, if together they cover every one of them (else none)."""
        covering = {sid: r for sid, r in self.loading.items() if any(r.start <= b < r.end for b in missing)}
        covered = all(any(r.start <= b < r.end for r in covering.values()) for b in missing)
        return sorted(covering) if covered and missing else []

    def _recheck_banned(self, missing) -> None:
        """Banned servers that would serve missing blocks are asked again: one that passes the connect check
        (restarted at its address) is routed to at once instead of after its ban."""
        banned, blocks = self.view.banned(), set(missing)
        retry = [r for sid, r in self.view.records.items() if sid in banned and blocks & set(range(r.start, r.end))]
        if retry:
            self.loop.run(self._measure(retry))

    def push(self, spans: list[Span]) -> bool:
        """Server-to-server push on this route: ClientConfig.push "on" / "off", or "auto": where it pays."""
        mode = self.config.push
        if len(spans) < 2:  # nobody to push to
            return False
        return mode == "on" or (mode == "auto" and self.router.push_pays(spans))

    def pass_cost(self, spans: list[Span]) -> Callable[[int], float]:
        """tokens -> predicted seconds of one step of that many tokens on this route (speculation's draft length)."""
        push = self.push(spans)
        return lambda n_tokens: self.router.pass_s(spans, n_tokens, push)

    def sibling(self, active_adapter: str | None) -> "RemoteSequence":
        """The same swarm seen with another adapter (or none): its own view, routes and channels (its sessions open
        with that adapter, on the servers that pre-load it), the DHT node, relays and connect-check verdicts shared."""
        return RemoteSequence(dataclasses.replace(self.config, active_adapter=active_adapter), self.num_blocks,
                              self.dht_prefix, share=self)

    def close(self) -> None:
        self.channels.close_idle()  # (its own, also a sibling's)
        if not self.owner:
            return
        if self.tunnels is not None:
            self.tunnels.close()
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None


def report_failure(reported: set[str], key: str, message: str, exc: BaseException) -> None:
    """One line at WARNING the first time a server fails (until it answers again), at DEBUG after that; the
    error's whole text (a gRPC error's repr spans lines) only at DEBUG."""
    log.log(logging.DEBUG if key in reported else logging.WARNING, "%s", message)
    log.debug("%s: %r", key, exc)
    if len(reported) > 4096:  # bounded, as `rejected`
        reported.clear()
    reported.add(key)


def _why_unreachable(exc: BaseException) -> str:
    """A connect failure in a few words ("connection refused", "DEADLINE_EXCEEDED", ...)."""
    text = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
    if "refused" in (text or "").lower():
        return "connection refused"
    return exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else f"{type(exc).__name__}: {exc}"


def _is_unauthenticated(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNAUTHENTICATED


def _raise_if_private(address: str, exc: BaseException) -> None:
    """A server that refuses us UNAUTHENTICATED belongs to a private swarm whose key we lack (server/auth.py)."""
    if _is_unauthenticated(exc):
        raise SwarmAccessDenied(f"server {address} refused this client: {exc.details()}") from None
