"""Where a server without `--blocks` goes, and when a running server should move.

The swarm's state comes from the DHT records; the decision is the planner's (`petals`: the window whose sorted
per-block throughput is smallest; `cg-bprr`: the window with the most uncovered demand). Block count: given,
or from the memory budget (weights + attention caches).
"""
from __future__ import annotations

import dataclasses
import logging

import psutil
from safetensors import safe_open

from swarmlm.config import ServerConfig
from swarmlm.model.checkpoint import TensorIndex, load_config, parse_dtype
from swarmlm.model.families import family_for
from swarmlm.model.quant import tensor_bytes
from swarmlm.perf.model import ComputeProfile, ModelSpec, ServerSpec
from swarmlm.planner.placement import blocks_for_concurrency, choose_range, lexicographic_window, petals_num_blocks
from swarmlm.swarm.records import ServerRecord
from swarmlm.types import BlockRange

log = logging.getLogger(__name__)
REBALANCE_GAIN = 0.2  # move only if the swarm's weakest block gets this much more throughput (Petals: ~25%)


def model_spec(config: ServerConfig) -> ModelSpec:
    """Bytes of one block (from the checkpoint's tensor shapes) and of one session's cache in one block."""
    cfg = load_config(config.model_dir)
    adapter = family_for(cfg)
    index = TensorIndex(config.model_dir)
    prefix = index.stack_prefix(adapter) + adapter.block_prefix().format(0)
    itemsize = parse_dtype(config.dtype, config.model_dir).itemsize
    nbytes = 0
    for key in index.files:
        if key.startswith(prefix):
            with safe_open(index.path(key), framework="pt") as f:  # (a hub id: fetched if not cached)
                nbytes += tensor_bytes(f.get_slice(key).get_shape(), itemsize, config.quant)  # int8: ~1/4
    spec = ModelSpec.from_config(cfg, l_in_max=0, l_max=config.max_length_tokens, dtype_bytes=itemsize)
    return dataclasses.replace(spec, block_bytes=float(nbytes))  # measured, not estimated


def memory_budget(config: ServerConfig) -> float:
    return float(config.memory_bytes or 0.4 * psutil.virtual_memory().available)


def _spec(record: ServerRecord, model: ModelSpec) -> ServerSpec:
    profile = ComputeProfile(record.prefill_a_s, record.prefill_b_s, record.decode_s)
    # a server that announces its weights' size (int8 ones are ~1/4 of fp32) is taken at its word
    memory = (record.weight_bytes or model.block_bytes * (record.end - record.start)) + record.cache_bytes_total
    return ServerSpec(name=record.server_id, memory_bytes=memory, profile=profile)


def _throughput(record: ServerRecord) -> float:
    return 1.0 / record.decode_s if record.decode_s > 0 else 1e9


def block_throughput(records: dict[str, ServerRecord], num_blocks: int) -> list[float]:
    """Tokens/s the swarm can push through each block (sum over the servers holding it)."""
    tput = [0.0] * num_blocks
    for r in records.values():
        for b in range(r.start, min(r.end, num_blocks)):
            tput[b] += _throughput(r)
    return tput


def num_blocks_for(config: ServerConfig, model: ModelSpec) -> int:
    if config.num_blocks is not None:
        return min(config.num_blocks, model.num_blocks)
    memory = memory_budget(config)
    if config.placement == "petals":
        m = petals_num_blocks(memory, model)
    else:
        m = blocks_for_concurrency(memory, model, concurrency=max(1, config.max_sessions // 4))
    if m < 1:
        raise ValueError(f"a memory budget of {memory / 2**30:.2f} GiB cannot hold one block with its caches")
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


def choose_blocks(config: ServerConfig, dht, prefix: str) -> BlockRange:
    from swarmlm.swarm.dht import fetch_records

    model = model_spec(config)
    records = fetch_records(dht, prefix, range(model.num_blocks), swarm_key=config.swarm_key) if dht is not None else {}
    blocks = choose_blocks_from(config, records, model)
    log.info("chose blocks %s (%s) from %d servers in the swarm", blocks, config.placement, len(records))
    return blocks


def should_move(config: ServerConfig, me: ServerRecord, records: dict[str, ServerRecord],
                model: ModelSpec) -> BlockRange | None:
    """A better range for this server, or None. Moves only when the weakest block gains REBALANCE_GAIN."""
    others = {sid: r for sid, r in records.items() if sid != me.server_id}
    current = BlockRange(me.start, me.end)
    fixed = ServerConfig(**{**config.__dict__, "num_blocks": current.length})
    candidate = choose_blocks_from(fixed, others, model, me.decode_s)
    if candidate == current:
        return None
    before = min(block_throughput({**others, me.server_id: me}, model.num_blocks))
    moved = ServerRecord(**{**me.__dict__, "start": candidate.start, "end": candidate.end})
    after = min(block_throughput({**others, me.server_id: moved}, model.num_blocks))
    if after > before * (1 + REBALANCE_GAIN) and after > before:
        return candidate
    return None
