"""A swarm server: load blocks, measure them, serve them over gRPC, announce them in the DHT.

Shutdown on SIGTERM/SIGINT is graceful: the server withdraws its records (no new routes reach it), refuses new
sessions, waits for open sessions to finish (up to `drain_timeout_s`), then stops.
"""
from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import logging
import signal
import sys
import threading
import time

import grpc
import torch

from swarmlm import event_loop
from swarmlm.collector import collection_times, freeze_start_up, thawed
from swarmlm.config import ServerConfig
from swarmlm.perf.model import ComputeProfile
from swarmlm.perf.profile import cached_profile
from swarmlm.server.scheduler import Scheduler
from swarmlm.server.service import ServerStats, SwarmService, measured_speeds
from swarmlm.server.auth import server_interceptors
from swarmlm.server.frame_server import FrameServer
from swarmlm.server.inbound import add_to_server
from swarmlm.server.stage import Stage
from swarmlm.swarm.identity import Identity
from swarmlm.swarm.records import LOADING, OFFLINE, ONLINE, ServerRecord, of_our_protocol, record_from_info
from swarmlm.types import BlockRange
from swarmlm.wire.channel import server_options

log = logging.getLogger(__name__)
GAP_CHECK_S = 2.0  # how often a placed server looks for blocks nobody serves (rebalance_period_s for the rest)


class Server:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.dht = None
        self.network = None  # in a swarm: reachability, relaying, tunnels to relayed servers (server/network.py)
        self.dht_prefix = None
        self.stage: Stage | None = None
        self.service: SwarmService | None = None
        self.address = ""
        self.identity = Identity.load_or_create(config.identity_file)  # its id is derived from its public key
        self.server_id = self.identity.server_id
        self.subkey: str | None = None
        self._stopping = threading.Event()
        self._moving = threading.Lock()  # the announcer stays quiet while the server changes its blocks
        self._announcer: threading.Thread | None = None  # (in a swarm) refreshes the DHT record
        self._tasks: list[asyncio.Task] = []  # on the server's loop: the expiry loop, then the rebalancer (if any)
        self._grpc: grpc.aio.Server | None = None
        self._frames: FrameServer | None = None  # the framed step port, beside gRPC (not when relayed)
        self._scheduler: Scheduler | None = None

    # ---- start-up -----------------------------------------------------------------------------------
    def _start_dht(self) -> None:
        from swarmlm.swarm.dht import default_dht_prefix, fetch_records, owner_subkey, start_dht

        cfg = self.config
        self.dht_prefix = cfg.dht_prefix or default_dht_prefix(cfg.model_dir)
        if cfg.initial_peers:
            from swarmlm.server.network import ServerNetwork

            self.network = ServerNetwork(cfg)  # behind NAT, its DHT node only asks (nobody could reach it)
            validator = self.identity.validator  # our key: it signs every record we announce
            self.dht = start_dht(cfg.initial_peers, host=cfg.host, validator=validator, swarm_key=cfg.swarm_key,
                                 client_mode=self.network.relayed,  # (on the network's p2pd: one per server)
                                 replicate=self.network.node.p2p.daemon_listen_maddr)
            self.subkey = owner_subkey(self.server_id, validator)
            if cfg.blocks is not None:  # (choosing blocks reads the swarm's records anyway)
                try:  # without the key, a private swarm's records stop us here: SwarmAccessDenied
                    fetch_records(self.dht, self.dht_prefix, range(cfg.blocks.start, cfg.blocks.end),
                                  swarm_key=cfg.swarm_key)
                except BaseException:
                    self.dht.shutdown()
                    raise

    def _choose_blocks(self) -> BlockRange:
        from swarmlm.server.placement import choose_blocks

        announce = self._announce_joining if self.dht is not None else None
        address = self.network.address(self.network.port) if self.network is not None else None
        return choose_blocks(self.config, self.dht, self.dht_prefix, self.server_id, announce, address)

    def _announce_joining(self, record: ServerRecord) -> None:
        """Its range before it serves (joining, loading): servers placing themselves see it, clients do not."""
        from swarmlm.swarm.dht import announce

        try:
            announce(self.dht, self.dht_prefix, record, self.config.record_ttl_s, subkey=self.subkey,
                     swarm_key=self.config.swarm_key)
        except Exception as exc:  # placement goes on with what it sees; a lost record only costs a rebalance
            log.warning("announcing the joining range failed: %s", exc)

    def record(self, state: str = ONLINE) -> ServerRecord:
        relay = self.network.relay if self.network is not None else ""
        return record_from_info(self.service.info(), self.address, state, relay)

    async def _peers(self, blocks, joining: bool = False) -> dict[str, ServerRecord]:
        """The DHT's records for `blocks` (fetched off the loop) of servers of our wire protocol: clients refuse any
        other, so no other covers a block, is a push target or a rival loader. `joining`: joining / loading too."""
        from swarmlm.swarm.dht import fetch_records

        return of_our_protocol(await asyncio.get_running_loop().run_in_executor(None, lambda: fetch_records(
            self.dht, self.dht_prefix, blocks, swarm_key=self.config.swarm_key, joining=joining)))

    async def _announced(self, block: int) -> set[str]:
        """Addresses of the servers of our wire protocol announced in the DHT for `block`."""
        records = await self._peers([block])
        self.network.learn(records.values())  # relayed ones: pushed to through their own relays (server/network.py)
        return {r.address for r in records.values() if r.start <= block < r.end and self.network.may_serve(r)}

    def _announce_loop(self) -> None:
        from swarmlm.swarm.dht import announce

        while not self._stopping.is_set():
            try:
                with self._moving:
                    announce(self.dht, self.dht_prefix, self.record(), self.config.record_ttl_s, subkey=self.subkey,
                             swarm_key=self.config.swarm_key)
            except Exception as exc:  # a missed refresh is retried; the record lives for ttl
                log.warning("announce failed: %s", exc)
            self._stopping.wait(self.config.announce_period_s)

    async def serve(self) -> None:
        """Serve until SIGTERM or SIGINT, then withdraw, drain and stop."""
        await self.start(owns_process=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await self.stop()

    async def start(self, owns_process: bool = False) -> None:
        """Join the swarm (if any), load and measure the blocks, listen, announce: serving when it returns.
        `owns_process`: this server is the process (`swarmlm server`), whose start-up heap it freezes."""
        from swarmlm.server.placement import check_memory

        from swarmlm.server.adapters import check_adapters

        cfg = self.config
        check_memory(cfg)  # blocks that do not fit its memory: one line, before joining or loading anything
        check_adapters(cfg.adapters, cfg.model_dir)  # a missing or mismatched adapter too
        torch.set_num_threads(cfg.threads)
        self._start_dht()
        blocks = self._choose_blocks()
        log.info("loading blocks %s of %s (dtype %s)", blocks, cfg.model_dir, cfg.dtype)  # minutes for big models
        self.stage = self._load_stage(blocks)
        profile = cached_profile(self.stage, cfg.threads, cfg.profile_cache_dir)
        stats = ServerStats(server_id=self.server_id, model=self.dht_prefix or "", **measured_speeds(profile))
        self._scheduler = Scheduler(cfg.threads, cfg.scheduler)
        self.service = SwarmService(cfg, self.stage, self._scheduler, stats)
        if self.dht is not None:  # pushes go only to servers announced for the next block (server/push.py)
            self.service.targets.directory = self._announced
            self.service.targets.relay_check = self.network.check_relay  # (the target's own relay)
        self.service.identity = self.identity  # signs the clients' connect checks (Info with a nonce)
        gate = server_interceptors(cfg.swarm_key)  # a private swarm's gate
        self._grpc = grpc.aio.server(options=server_options(cfg.max_message_bytes), interceptors=gate,
                                     maximum_concurrent_rpcs=cfg.max_concurrent_rpcs)
        add_to_server(self.service, self._grpc)  # (bytes that do not parse: INVALID_ARGUMENT)
        local_port = self._listen(self._grpc)
        self.service.address = self.address
        if self.network is not None:
            self.service.relay = lambda: self.network.relay  # (signed in its Info: swarm/identity.py)
        await self._grpc.start()
        relayed = self.network is not None and self.network.relayed
        if relayed:  # behind NAT: relayed connections to local_port (gRPC only: docs/PROTOCOL.md, "Framed steps")
            self.network.serve_relayed(local_port)
        elif cfg.frames:  # the same handlers on a framed port (server/frame_server.py), checked by the same gate
            self._frames = FrameServer(self.service, cfg, gate[0].checker if gate else None)
            self.service.frame_port = await self._frames.start(cfg.host)
        self._tasks = [asyncio.create_task(self.service.streams.expire_loop())]
        if owns_process:  # start-up's objects (torch, the blocks' modules, imports) out of every later collection's
            freeze_start_up()  # walk (swarmlm/collector.py); not a host's heap (a test's in-process server)
        collection_times()  # (counted from here, serving: Info reports them)
        if self.dht is not None:
            self._announcer = threading.Thread(target=self._announce_loop, name="swarmlm-announce", daemon=True)
            self._announcer.start()
        self._print_ready(profile)
        log.info("serving blocks %s at %s", blocks, self.address)
        if self.dht is not None and cfg.blocks is None and cfg.rebalance_period_s > 0:
            self._tasks.append(asyncio.create_task(self._rebalance_loop()))

    async def stop(self) -> None:
        """Withdraw, let open sessions finish (up to drain_timeout_s), stop listening and computing."""
        expiry, *rebalancer = self._tasks
        for task in rebalancer:  # it moves nothing any more
            task.cancel()
        await self._drain(self._announcer)
        expiry.cancel()  # (expiry goes on while sessions drain)
        if self._frames is not None:
            await self._frames.stop()
        await self._grpc.stop(grace=2.0)
        await self.service.pusher.close()
        self._scheduler.stop()
        if self.dht is not None:
            self.dht.shutdown()
        if self.network is not None:
            self.network.close()

    def _listen(self, server: grpc.aio.Server) -> int:
        """gRPC's ports; sets the address to announce. Returns the port relayed connections arrive at (loopback)."""
        cfg = self.config
        wanted = self.network.grpc_port() if self.network is not None else cfg.port
        port = server.add_insecure_port(f"{cfg.host}:{wanted}")
        if port == 0:
            raise OSError(f"cannot listen on {cfg.host}:{wanted}")
        self.address = (self.network.address(port) if self.network is not None
                        else f"{cfg.announce_host or cfg.host}:{port}")
        if self.network is not None and self.network.relayed and cfg.host not in ("127.0.0.1", "0.0.0.0"):
            return server.add_insecure_port("127.0.0.1:0")
        return port

    async def _drain(self, announcer: threading.Thread | None) -> None:
        """Withdraw from the swarm, then let open sessions finish."""
        self._stopping.set()
        self.service.accepting = False
        if announcer is not None:
            announcer.join(timeout=5)
            from swarmlm.swarm.dht import announce

            try:
                announce(self.dht, self.dht_prefix, self.record(OFFLINE), self.config.record_ttl_s, subkey=self.subkey,
                         swarm_key=self.config.swarm_key)
            except Exception as exc:
                log.warning("withdrawal failed: %s", exc)
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self.service.sessions.sessions and time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    async def _rebalance_loop(self) -> None:
        """Every period: would moving raise the swarm's weakest block throughput enough? Then move. Blocks that nobody
        serves any more (a dead server's) are looked for more often, every GAP_CHECK_S: clients wait for them."""
        from swarmlm.server.placement import LoadingWatch, model_spec, should_move, uncovered

        loop = asyncio.get_running_loop()
        model = await loop.run_in_executor(None, model_spec, self.config)
        period = self.config.rebalance_period_s
        next_check = time.monotonic() + period
        watch = LoadingWatch(self.config.max_loading_s)  # (loaders that never serve stop counting)
        while True:
            await asyncio.sleep(min(period, GAP_CHECK_S))
            try:
                # joiners count (no move onto them); servers of another wire protocol do not (clients refuse them)
                records = await self._peers(range(model.num_blocks), joining=True)
                records = watch.trusted(records, model.num_blocks, time.monotonic())
                if time.monotonic() < next_check and not uncovered(records, model.num_blocks):
                    continue
                next_check = time.monotonic() + period
                target = should_move(self.config, self.record(), records, model)
                if target is not None:
                    await self._move(target, watch)
            except Exception:
                log.exception("rebalancing check failed; staying")

    async def _move(self, blocks: BlockRange, watch) -> None:
        """Serve `blocks` instead: announce them as loading (kept announced until loaded; clients wait for it), back
        off if a server of a smaller id announced loading them too, else withdraw, hand open sessions back to their
        clients' failover, free the old blocks, load the new ones (only their bytes are read; never both held: the
        memory limit holds), announce."""
        log.info("rebalancing: moving from %s to %s", self.stage.blocks, blocks)
        loop = asyncio.get_running_loop()
        with self._moving:
            self.service.accepting = False
            # the new range as loading: clients stop routing here, other servers placing themselves count it
            loading = dataclasses.replace(self.record(LOADING), start=blocks.start, end=blocks.end)
            await loop.run_in_executor(None, self._store, loading)
            keeper = asyncio.create_task(self._keep_announced(loading))
            try:
                rival = await self._rival_loader(loading, watch)
                if rival is not None:
                    log.info("not moving to %s: server %s (a smaller id) announced loading %d:%d too", blocks,
                             rival.server_id, rival.start, rival.end)
                    self.service.accepting = True
                    return
                stage, blocks = await self._swap_blocks(blocks)
            finally:
                keeper.cancel()
            self.service.accepting = True
        print(json.dumps({"event": "moved", "server_id": self.server_id, "blocks": [blocks.start, blocks.end],
                          "weight_bytes": stage.weight_bytes}), flush=True)

    def _store(self, record: ServerRecord) -> None:
        from swarmlm.swarm.dht import announce

        announce(self.dht, self.dht_prefix, record, self.config.record_ttl_s, subkey=self.subkey,
                 swarm_key=self.config.swarm_key)

    async def _keep_announced(self, record: ServerRecord) -> None:
        """Re-announce `record` every announce period (a move outlasts record_ttl_s: 30-51 s for llama-8b here)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.config.announce_period_s)
            try:
                await loop.run_in_executor(None, self._store, record)
            except Exception as exc:  # retried next period
                log.warning("announcing the loading range failed: %s", exc)

    async def _rival_loader(self, me: ServerRecord, watch) -> ServerRecord | None:
        """After one announce period (records of servers that chose in the same check have landed): a server of a
        smaller id loading the same blocks (placement.first_loader), not one stuck past max_loading_s nor one of
        another wire protocol."""
        from swarmlm.server.placement import first_loader

        await asyncio.sleep(self.config.announce_period_s)
        records = await self._peers(range(me.start, me.end), joining=True)
        return first_loader(me, watch.without_stale(records, time.monotonic()))

    async def _swap_blocks(self, blocks: BlockRange) -> tuple[Stage, BlockRange]:
        """Close the sessions, free the old blocks, load `blocks` (the old ones again if that fails)."""
        cfg = self.config
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + min(cfg.drain_timeout_s, 5.0)
        while self.service.sessions.sessions and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for sid in list(self.service.sessions.sessions):  # their next step fails: clients fail over
            self.service.sessions.close(sid)
        if self.service.prefixes is not None:
            self.service.prefixes.shrink_to(0)  # (kept for the old blocks only)
        old = self.stage.blocks
        with thawed():  # the old blocks' objects were frozen with start-up's: collectable again, the new ones frozen
            self.stage.release()
            gc.collect()
            try:
                stage = await loop.run_in_executor(None, self._load_stage, blocks)
            except Exception:  # (a file gone, memory refused): serve the old blocks again
                log.exception("loading %s failed: reloading %s", blocks, old)
                stage, blocks = await loop.run_in_executor(None, self._load_stage, old), old
        profile = await loop.run_in_executor(None, cached_profile, stage, cfg.threads, cfg.profile_cache_dir)
        self.stage = self.service.stage = stage
        self.service.stats = dataclasses.replace(self.service.stats, **measured_speeds(profile))
        return stage, blocks

    def _load_stage(self, blocks: BlockRange) -> Stage:
        cfg = self.config
        t0 = time.perf_counter()
        stage = Stage(cfg.model_dir, blocks, cfg.dtype, cfg.quant, cfg.mmap_weights, cfg.kv_dtype)
        stage.load_adapters(cfg.adapters)
        log.info("loaded %d blocks in %.1f s (%.0f MiB)", blocks.length, time.perf_counter() - t0,
                 stage.weight_bytes / 2**20)
        return stage

    def _print_ready(self, profile) -> None:
        # one JSON line on stdout: launchers (demo, tests, bench) wait for it
        print(json.dumps({
            "event": "ready", "server_id": self.server_id, "address": self.address,
            "blocks": [self.stage.blocks.start, self.stage.blocks.end], **measured_speeds(profile),
            "event_loop": event_loop.name_of(asyncio.get_running_loop()),  # (SWARMLM_EVENT_LOOP's A/B runs check it)
        }), flush=True)


def profile_model(model_dir: str, blocks: BlockRange | None, dtype: str, threads: int,
                  cache_dir: str | None = None, refresh: bool = False, quant: str = "auto") -> ComputeProfile:
    """The compute profile a server over `blocks` (default: all) would announce (cached on disk)."""
    from swarmlm.model.checkpoint import load_config

    if blocks is None:
        blocks = BlockRange(0, int(load_config(model_dir).num_hidden_layers))
    return cached_profile(Stage(model_dir, blocks, dtype, quant), threads, cache_dir, refresh)


def run_server(config: ServerConfig) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    event_loop.run(Server(config).serve())
    return 0
