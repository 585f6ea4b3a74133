"""Where a server without `--blocks` goes, and when a running server should move.

The swarm's state comes from the DHT records; the decision is the planner's (`petals`: the window whose sorted
per-block throughput is smallest; `cg-bprr`: the window with the most uncovered demand). Block count: given,
or from the memory budget (weights + attention caches).

Servers that start together cannot see each other at first (a server announces itself once loaded), so each would
take the same least-served window. A server placing itself therefore announces its choice at once as `joining`
(never routed to), and re-checks it after a random pause against the records that appeared meanwhile: it yields to
the servers that serve or load, and to those that joined before it, whose choices it waits for. Once none of those
is still choosing, its choice is final: it announces it as `loading` and loads (`settle`). Joiners thus choose one
after another, as if they had started one by one.
"""
from __future__ import annotations

import dataclasses
import logging
import random
import statistics
import time
from typing import Callable

import psutil

from swarmlm.config import ServerConfig
from swarmlm.errors import MemoryBudgetExceeded
from swarmlm.model.checkpoint import load_config, parse_dtype, tensor_index
from swarmlm.model.families import family_for
from swarmlm.model.quant import keeps_file_blocks, loaded_bytes
from swarmlm.perf.model import ComputeProfile, ModelSpec, ServerSpec
from swarmlm.planner.placement import blocks_for_concurrency, choose_range, lexicographic_window, petals_num_blocks
from swarmlm.server.kv_dtype import cache_dtype
from swarmlm.swarm.records import JOINING, LOADING, ONLINE, ServerRecord, of_our_protocol
from swarmlm.types import BlockRange
from swarmlm.wire.protocol import PROTOCOL_VERSION

log = logging.getLogger(__name__)
REBALANCE_GAIN = 0.2  # move only if the swarm's weakest block gets this much more throughput (Petals: ~25%)
JOIN_CHECKS = 8  # a joining server re-checks its choice at most this many times (~one per joiner ahead of it)


def model_spec(config: ServerConfig) -> ModelSpec:
    """Bytes of one block (block 0, as loaded) and of one session's cache in one block."""
    cfg = load_config(config.model_dir)
    dtype = parse_dtype(config.dtype, config.model_dir)
    spec = ModelSpec.from_config(cfg, l_in_max=0, l_max=config.max_length_tokens, dtype_bytes=dtype.itemsize,
                                 cache_bytes_per_value=cache_dtype(config.kv_dtype, dtype).itemsize)
    return dataclasses.replace(spec, block_bytes=float(range_bytes(config, BlockRange(0, 1))))  # measured


def range_bytes(config: ServerConfig, blocks: BlockRange) -> int:
    """Bytes the blocks' weights take once loaded, from the checkpoint's tensor table (nothing read): a GGUF's
    matrices kept packed at about their bytes in the file, other tensors at the compute dtype's size (int8 / int4: their
    blocks' size)."""
    cfg = load_config(config.model_dir)
    adapter = family_for(cfg)
    index = tensor_index(config.model_dir)
    itemsize = parse_dtype(config.dtype, config.model_dir).itemsize
    gguf = getattr(index, "gguf", None)
    packed = gguf is not None and keeps_file_blocks(config.quant, True)
    prefixes = tuple(index.stack_prefix(adapter) + adapter.block_prefix().format(b) for b in range(blocks.start, blocks.end))
    nbytes = 0
    for key in index.files:
        if key.startswith(prefixes):
            shape = index.shape(key)
            kept = _held_packed_bytes(gguf, key, shape) if packed and gguf.packable(key) else None
            nbytes += loaded_bytes(shape, itemsize, config.quant, kept)
    return nbytes


def _held_packed_bytes(gguf, key: str, shape: list[int]) -> int:
    """A GGUF matrix kept in its blocks, as the packed kernels hold it (model/packed.py held_row_bytes): the file's
    bytes, but Q4_K's and Q5_K's splits (148 and 180 bytes per 256 values, 144 and 176 in the file)."""
    from swarmlm.model.packed import held_row_bytes

    type_name = gguf.tensors[gguf.hf_to_gguf[key]].tensor_type.name
    return int(shape[0]) * held_row_bytes(type_name, int(shape[1]))


def memory_budget(config: ServerConfig) -> float:
    return float(config.memory_bytes or 0.4 * psutil.virtual_memory().available)


def _spec(record: ServerRecord, model: ModelSpec) -> ServerSpec:
    profile = ComputeProfile(record.prefill_a_s, record.prefill_b_s, record.decode_s)
    # a server that announces its weights' size (int8 ones are ~1/4 of fp32) is taken at its word
    memory = (record.weight_bytes or model.block_bytes * (record.end - record.start)) + record.cache_bytes_total
    return ServerSpec(name=record.server_id, memory_bytes=memory, profile=profile)


def block_throughput(records: dict[str, ServerRecord], num_blocks: int) -> list[float]:
    """Tokens/s the swarm can push through each block (sum over the servers holding it). A server that has not
    measured itself yet (joining) counts as a typical one: the median of the others' speeds."""
    known = [1.0 / r.decode_s for r in records.values() if r.decode_s > 0]
    typical = statistics.median(known) if known else 1.0
    tput = [0.0] * num_blocks
    for r in records.values():
        for b in range(r.start, min(r.end, num_blocks)):
            tput[b] += 1.0 / r.decode_s if r.decode_s > 0 else typical
    return tput


def memory_limit(config: ServerConfig) -> tuple[float, str]:
    """What a server's weights and attention cache must fit in: --memory-mb, else the memory available now."""
    if config.memory_bytes:
        return float(config.memory_bytes), "--memory-mb"
    return float(psutil.virtual_memory().available), "available memory"


def memory_need(config: ServerConfig, weight_bytes: float) -> float:
    """A server's memory: its blocks' weights as loaded plus the attention-cache budget it reserves (--cache-mb).
    The process itself (Python, torch, gRPC, DHT: ~0.5 GB resident) is outside the budget, as Petals' reserve."""
    return weight_bytes + config.cache_bytes


def check_fits(config: ServerConfig, blocks: BlockRange) -> None:
    """Raise MemoryBudgetExceeded (one line) if the blocks and the cache budget do not fit the memory limit."""
    limit, source = memory_limit(config)
    weights = range_bytes(config, blocks)
    if memory_need(config, weights) > limit:
        mib = 2**20
        raise MemoryBudgetExceeded(
            f"blocks {blocks.start}:{blocks.end} need {weights / mib:.0f} MiB of weights (quant {config.quant}) + "
            f"{config.cache_bytes / mib:.0f} MiB of attention cache (--cache-mb) = "
            f"{memory_need(config, weights) / mib:.0f} MiB, more than the {limit / mib:.0f} MiB of {source}")


def check_memory(config: ServerConfig) -> None:
    """Before anything is loaded or announced: --blocks or --num-blocks that do not fit are refused in one line,
    and so is a budget that holds no block at all."""
    if config.blocks is not None:
        check_fits(config, config.blocks)
        return
    model = model_spec(config)
    if config.num_blocks is not None:
        check_fits(config, BlockRange(0, min(config.num_blocks, model.num_blocks)))  # (blocks of one size)
    else:
        num_blocks_for(config, model)


def blocks_that_fit(config: ServerConfig, model: ModelSpec) -> int:
    """The most blocks (of block 0's size) whose weights and cache budget fit the memory limit."""
    limit, _ = memory_limit(config)
    return max(0, min(model.num_blocks, int((limit - memory_need(config, 0)) // model.block_bytes)))


def num_blocks_for(config: ServerConfig, model: ModelSpec) -> int:
    """--num-blocks as given (checked by check_fits); with --memory-mb, as many as fit it (weights + --cache-mb: its
    one meaning); else the placement policy's count within memory_budget, never more than fit the memory limit."""
    if config.num_blocks is not None:
        return min(config.num_blocks, model.num_blocks)
    memory = memory_budget(config)
    if config.memory_bytes:
        m = blocks_that_fit(config, model)
    elif config.placement == "petals":
        m = petals_num_blocks(memory, model)
    else:
        m = blocks_for_concurrency(memory, model, concurrency=max(1, config.max_sessions // 4))
    m = min(m, blocks_that_fit(config, model))
    if m < 1:
        raise MemoryBudgetExceeded(f"a memory budget of {memory / 2**30:.2f} GiB cannot hold one block "
                                   f"({model.block_bytes / 2**20:.0f} MiB) with its caches")
    return m


def choose_blocks_from(config: ServerConfig, records: dict[str, ServerRecord], model: ModelSpec,
                       own_decode_s: float = 0.0) -> BlockRange:
    """The range a server with this config would take, given the other servers' records."""
    m = num_blocks_for(config, model)
    if config.placement == "petals":
        start = lexicographic_window(block_throughput(records, model.num_blocks), m)
        return BlockRange(start, start + m)
    existing = {sid: (_spec(r, model), BlockRange(r.start, min(r.end, model.num_blocks))) for sid, r in records.items()}
    concurrency = max(1, config.max_sessions // 4)
    # memory that fits exactly m blocks with R caches, so the planner's own step 1 gives m
    memory = m * (model.block_bytes + model.cache_bytes_per_session_block * concurrency)
    me = ServerSpec(name="joining", memory_bytes=memory, profile=ComputeProfile(0.0, 0.0, own_decode_s))
    return choose_range(me, existing, model, "cg-bprr", concurrency=concurrency)


def ahead_of(me: ServerRecord, records: dict[str, ServerRecord]) -> dict[str, ServerRecord]:
    """The servers a joining one yields to: those serving or loading, and those that joined before it (same instant:
    the smaller id). Every joiner orders the others the same way, so their choices settle one after another."""
    return {sid: r for sid, r in records.items() if sid != me.server_id
            and (r.state != JOINING or (r.joined_at, sid) < (me.joined_at, me.server_id))}


def settle(config: ServerConfig, model: ModelSpec, me: ServerRecord,
           fetch: Callable[[], dict[str, ServerRecord]], announce: Callable[[ServerRecord], None]) -> BlockRange:
    """Choose from every record seen and announce it as joining (`me`: id and address); then, every
    0.5-1.5 x config.join_settle_s (random: joiners' records land meanwhile), choose again among the servers ahead
    of it, until none of them is still choosing; announce the final range as loading. A joiner ahead that never
    settles (gone, or hostile) holds it JOIN_CHECKS checks at most."""
    blocks = choose_blocks_from(config, fetch(), model)
    # joined_at is taken as the record leaves: a joiner ahead of another is visible to it by its first re-check
    me = dataclasses.replace(me, start=blocks.start, end=blocks.end, state=JOINING, joined_at=time.time())
    for _ in range(JOIN_CHECKS if config.join_settle_s > 0 else 0):
        announce(me)
        time.sleep(config.join_settle_s * random.uniform(0.5, 1.5))
        ahead = ahead_of(me, fetch())
        blocks = choose_blocks_from(config, ahead, model)
        me = dataclasses.replace(me, start=blocks.start, end=blocks.end)
        choosing = sum(r.state == JOINING for r in ahead.values())
        log.info("joining: %s against %d servers ahead (%d still choosing)", blocks, len(ahead), choosing)
        if not choosing:
            break
    else:
        if config.join_settle_s > 0:
            log.info("joiners ahead still choosing after %d checks: taking %s", JOIN_CHECKS, blocks)
    announce(dataclasses.replace(me, state=LOADING))
    return blocks


def choose_blocks(config: ServerConfig, dht, dht_prefix: str, server_id: str = "",
                  announce: Callable[[ServerRecord], None] | None = None, address: str | None = None) -> BlockRange:
    """The range to load: --blocks as given; alone (no DHT), the first window; in a swarm, settled with the other
    joiners. In a swarm (`announce` stores a record) the range is announced as loading before it loads, so servers
    placing themselves meanwhile count it."""
    from swarmlm.swarm.dht import fetch_records

    # (port 0: not known before loading; a server behind NAT: its p2p address, server/network.py)
    address = address or f"{config.announce_host or config.host}:{config.port}"
    me = ServerRecord(server_id=server_id, address=address, start=0, end=1, state=JOINING, protocol=PROTOCOL_VERSION)
    if config.blocks is not None:
        if announce is not None:
            announce(dataclasses.replace(me, start=config.blocks.start, end=config.blocks.end, state=LOADING,
                                         joined_at=time.time()))
        return config.blocks
    model = model_spec(config)
    if dht is None or announce is None:
        return choose_blocks_from(config, {}, model)

    def fetch() -> dict[str, ServerRecord]:  # (servers of another wire protocol cover nothing: clients refuse them)
        return of_our_protocol(fetch_records(dht, dht_prefix, range(model.num_blocks), swarm_key=config.swarm_key,
                                             joining=True))

    blocks = settle(config, model, me, fetch, announce)
    log.info("chose blocks %s (%s)", blocks, config.placement)
    return blocks


def uncovered(records: dict[str, ServerRecord], num_blocks: int) -> list[int]:
    """Blocks no server serves or loads (a dead server's, once its record expired)."""
    return [b for b, t in enumerate(block_throughput(records, num_blocks)) if t == 0]


def should_move(config: ServerConfig, me: ServerRecord, records: dict[str, ServerRecord],
                model: ModelSpec) -> BlockRange | None:
    """A better range for this server, or None. Moves only when the weakest block gains REBALANCE_GAIN (a block
    nobody serves counts as 0: any cover gains), and only to blocks that fit its memory limit (check_fits)."""
    others = {sid: r for sid, r in records.items() if sid != me.server_id}
    current = BlockRange(me.start, me.end)
    fixed = ServerConfig(**{**config.__dict__, "num_blocks": current.length})
    candidate = choose_blocks_from(fixed, others, model, me.decode_s)
    if candidate == current:
        return None
    before = min(block_throughput({**others, me.server_id: me}, model.num_blocks))
    moved = ServerRecord(**{**me.__dict__, "start": candidate.start, "end": candidate.end})
    after = min(block_throughput({**others, me.server_id: moved}, model.num_blocks))
    if not (after > before * (1 + REBALANCE_GAIN) and after > before):
        return None
    try:
        check_fits(config, candidate)
    except MemoryBudgetExceeded as exc:
        log.warning("not moving to %s: %s", candidate, exc)
        return None
    return candidate


class LoadingWatch:
    """Blocks that only joining / loading records cover, and since when (this server's clock): after `limit_s` their
    loaders stop counting, so a spare may move onto them. Kept per block, not per server, so a hostile peer cannot
    restart the clock by announcing under new ids; a block some server serves online is forgotten."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.since: dict[int, float] = {}  # block -> when only loaders were first seen on it

    def trusted(self, records: dict[str, ServerRecord], num_blocks: int, now: float) -> dict[str, ServerRecord]:
        """Note what the swarm's `records` (all its blocks) cover now; return them without the loaders of blocks
        that nobody has served for longer than limit_s."""
        online = {b for r in records.values() if r.state == ONLINE for b in range(r.start, min(r.end, num_blocks))}
        waiting = {b for r in records.values() if r.state != ONLINE
                   for b in range(r.start, min(r.end, num_blocks))} - online
        self.since = {b: self.since.get(b, now) for b in waiting}
        return self.without_stale(records, now)

    def without_stale(self, records: dict[str, ServerRecord], now: float) -> dict[str, ServerRecord]:
        """`records` (any subset) without the loaders of the blocks found stale so far."""
        stale = {b for b, t in self.since.items() if now - t > self.limit_s}
        return {sid: r for sid, r in records.items()
                if r.state == ONLINE or not any(r.start <= b < r.end for b in stale)}


def first_loader(me: ServerRecord, records: dict[str, ServerRecord]) -> ServerRecord | None:
    """Another server loading blocks that `me` (announced as loading) is about to load, with a smaller id: two spares
    that took one gap in the same check saw each other only after announcing; every server orders them the same
    way, so exactly one (the smallest id) goes on."""
    rivals = [r for sid, r in records.items() if sid < me.server_id and r.state == LOADING
              and r.start < me.end and me.start < r.end]
    return min(rivals, key=lambda r: r.server_id, default=None)
