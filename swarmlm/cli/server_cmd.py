"""`swarmlm server --model DIR|ORG/NAME --blocks START:END --initial-peers ADDR ...`"""
from __future__ import annotations

import argparse
from dataclasses import replace

from swarmlm.cli.args import add_model, add_swarm_key, block_range, model_ref
from swarmlm.config import QUANT_NAMES, SchedulerConfig

SCHEDULER = SchedulerConfig()  # the flags' defaults


def add_parser(sub) -> None:
    p = sub.add_parser("server", help="serve a range of the model's blocks")
    add_model(p)  # a hub id downloads (or reads from the HF cache) only the shards of the served blocks
    p.add_argument("--blocks", type=block_range, help="half-open range START:END; omit to let the server choose")
    p.add_argument("--identity", metavar="FILE",
                   help="the server's private key (PEM; created 0600 if absent): keeps its id across restarts "
                        "(default: a fresh key and id per run)")
    add_swarm_key(p)
    p.add_argument("--num-blocks", type=int, help="with no --blocks: how many blocks to take (default: from memory)")
    p.add_argument("--placement", default="petals", choices=["petals", "cg-bprr"],
                   help="with no --blocks: how to choose the range")
    p.add_argument("--initial-peers", nargs="*", default=[], help="DHT multiaddrs (none: no swarm, direct use)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--announce-host", help="address others dial, if not --host")
    p.add_argument("--threads", type=int, default=1, help="torch threads for compute")
    p.add_argument("--quant", default="none", choices=QUANT_NAMES,
                   help="int8: the blocks' linear layers quantized on load (~1/4 of fp32's weight memory, faster "
                        "decode on CPU, ~1 %% logits error; needs float32; announced to clients)")
    p.add_argument("--mmap-weights", action="store_true",
                   help="serve full-precision weights from the checkpoint file's mapping (pages shared by servers of "
                        "the same file on one host) instead of copying them into the process: less memory per "
                        "extra server, ~1.5x slower decode on the machine we measured")
    p.add_argument("--cache-mb", type=int, default=256, help="attention-cache budget across sessions, MiB")
    p.add_argument("--prefix-cache-mb", type=int, default=64,
                   help="finished sessions' prefixes kept for later sessions, within --cache-mb, MiB (0 = off)")
    p.add_argument("--memory-mb", type=int, help="memory budget for weights + caches when choosing --num-blocks")
    p.add_argument("--max-sessions", type=int, default=64)
    p.add_argument("--max-length", type=int, default=2048, help="longest session accepted, tokens")
    p.add_argument("--max-batch-tokens", type=int, default=SCHEDULER.max_batch_tokens,
                   help="continuous batching: tokens (rows x new tokens) one compute round may take across sessions")
    p.add_argument("--max-prefill-skips", type=int, default=SCHEDULER.max_prefill_skips,
                   help="rounds the oldest prefill that does not fit --max-batch-tokens may wait before it runs anyway")
    p.add_argument("--batch-wait", type=float, default=SCHEDULER.batch_wait.fraction,
                   help="before a round, wait up to this fraction of the last decode forward (max "
                        f"{SCHEDULER.batch_wait.max_s * 1000:g} ms) for its "
                        "sessions' next steps, so sessions in lockstep share a forward (0 = never)")
    p.add_argument("--inline-decode-max-ms", type=float, default=SCHEDULER.inline_decode_max_s * 1000,
                   help="a lone session's decode step whose forward takes at most this long runs on the server's I/O "
                        "loop, without the hand-off to the compute thread (0 = never)")
    p.add_argument("--max-message-mb", type=int, default=64, help="largest gRPC message accepted, MiB")
    p.add_argument("--idle-timeout", type=float, default=120.0, help="close sessions idle this long, seconds")
    # limits against greedy or hostile peers (docs/FAILURES.md); a peer is a remote host
    p.add_argument("--open-idle-timeout", type=float, default=10.0,
                   help="close a session whose first step has not run this long after its open, seconds")
    p.add_argument("--resume-grace", type=float, default=5.0,
                   help="close a session whose stream broke unless it is resumed (with its secret) this soon, seconds")
    p.add_argument("--max-sessions-per-peer", type=int, default=32, help="open sessions one host may hold")
    p.add_argument("--max-concurrent-rpcs", type=int, default=256, help="gRPC calls at once (streams included)")
    p.add_argument("--rebalance-period", type=float, default=30.0,
                   help="with no --blocks: check every this many seconds whether moving helps the swarm (0 = never)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="on SIGTERM, wait this long for sessions")


def run(args: argparse.Namespace) -> int:
    model = model_ref(args)  # a bad path fails before the slow imports
    from swarmlm.config import ServerConfig
    from swarmlm.server.server import run_server

    config = ServerConfig(
        model_dir=model, blocks=args.blocks,
        initial_peers=tuple(args.initial_peers), host=args.host, port=args.port, announce_host=args.announce_host,
        threads=args.threads, dtype=args.dtype, num_blocks=args.num_blocks, placement=args.placement,
        memory_bytes=args.memory_mb << 20 if args.memory_mb else None, cache_bytes=args.cache_mb << 20,
        prefix_cache_bytes=args.prefix_cache_mb << 20,
        max_sessions=args.max_sessions, max_length_tokens=args.max_length,
        scheduler=SchedulerConfig(
            max_batch_tokens=args.max_batch_tokens, max_prefill_skips=args.max_prefill_skips,
            batch_wait=replace(SCHEDULER.batch_wait, fraction=args.batch_wait),
            inline_decode_max_s=args.inline_decode_max_ms / 1000),
        session_idle_timeout_s=args.idle_timeout, open_idle_timeout_s=args.open_idle_timeout,
        resume_grace_s=args.resume_grace, max_sessions_per_peer=args.max_sessions_per_peer,
        max_concurrent_rpcs=args.max_concurrent_rpcs, max_message_bytes=args.max_message_mb << 20, dht_prefix=args.dht_prefix,
        identity_file=args.identity, swarm_key=args.swarm_key, quant=args.quant,
        mmap_weights=args.mmap_weights,
    )
    return run_server(config, drain_timeout_s=args.drain_timeout, rebalance_period_s=args.rebalance_period)
