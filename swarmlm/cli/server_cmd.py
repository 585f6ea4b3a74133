"""`swarmlm server --model DIR|ORG/NAME --blocks START:END --initial-peers ADDR ...`"""
from __future__ import annotations

import argparse
from dataclasses import replace

from swarmlm.cli.args import add_model, add_swarm_key, block_range, model_ref
from swarmlm.config import KV_DTYPE_NAMES, QUANT_NAMES, SchedulerConfig, ServerConfig

# the flags' defaults: each setting's one definition is its config field
SERVER = ServerConfig(model_dir="", blocks=None)
SCHEDULER = SERVER.scheduler
MIB = 1 << 20
# --help lists these first ("common options"), the rest under "advanced options"
COMMON = ("--model", "--blocks", "--num-blocks", "--initial-peers", "--host", "--port", "--threads", "--adapters",
          "--memory-mb", "--swarm-key")


def add_parser(sub) -> None:
    p = sub.add_parser("server", help="serve a range of the model's blocks")
    add_model(p)  # a hub id downloads (or reads from the HF cache) only the shards of the served blocks
    p.add_argument("--blocks", type=block_range, help="half-open range START:END; omit to let the server choose")
    p.add_argument("--identity", metavar="FILE",
                   help="the server's private key (PEM; created 0600 if absent): keeps its id across restarts "
                        "(default: a fresh key and id per run)")
    add_swarm_key(p)
    p.add_argument("--reachability", default=SERVER.reachability, choices=["auto", "direct", "relayed"],
                   help="auto: a relay dials this server back at start-up, and if that fails it is served through a "
                        "relay (behind NAT); direct / relayed: no check (docs/PROTOCOL.md, Servers behind NAT)")
    p.add_argument("--num-blocks", type=int, help="with no --blocks: how many blocks to take (default: from memory)")
    p.add_argument("--placement", default=SERVER.placement, choices=["petals", "cg-bprr"],
                   help="with no --blocks: how to choose the range")
    p.add_argument("--initial-peers", nargs="*", default=[], help="DHT multiaddrs (none: no swarm, direct use)")
    p.add_argument("--host", default=SERVER.host,
                   help="the interface to listen on (0.0.0.0: every interface, for clients on other machines)")
    p.add_argument("--port", type=int, default=SERVER.port, help="the gRPC port (0: any free port)")
    p.add_argument("--announce-host", help="address others dial, if not --host")
    p.add_argument("--threads", type=int, default=SERVER.threads,
                   help="torch threads for compute (default: the cores this process may use, here %(default)s)")
    p.add_argument("--no-frames", dest="frames", action="store_false",
                   help="serve decode steps and pushes on gRPC only, no framed step port beside it (a second TCP "
                        "port, any free one, on --host; docs/PROTOCOL.md, Framed steps)")
    p.add_argument("--push-frames", action=argparse.BooleanOptionalAction, default=SERVER.push_frames,
                   help="push to the next server on its framed step port when it announces one, else on gRPC "
                        "(default: %(default)s)")
    p.add_argument("--one-call-steps", action=argparse.BooleanOptionalAction, default=SERVER.one_call_steps,
                   help="answer a lone session's compact decode step of a packed span in one kernel call (values "
                        "checked, the span, the ANSWER frame: kernels/lane.c) (default: %(default)s)")
    p.add_argument("--step-lane", action=argparse.BooleanOptionalAction, default=SERVER.step_lane,
                   help="take a lone session's plain decode steps in one C call as they arrive on the framed port, "
                        "no Python between the socket and the kernel (server/lane.py; default: %(default)s)")
    p.add_argument("--quant", default=SERVER.quant, choices=QUANT_NAMES,
                   help="auto: a GGUF's quantized blocks kept as the file has them; none: dequantized; int8 / int4: a "
                        "float checkpoint's linear layers quantized weight-only in blocks of 32 (announced to "
                        "clients) (model/quant.py)")
    p.add_argument("--kv-dtype", default=SERVER.kv_dtype, choices=KV_DTYPE_NAMES,
                   help="what the sessions' attention caches hold: float16 = half the bytes per cached token (twice "
                        "the context or sessions in --cache-mb), keys and values rounded to float16; float32; auto = "
                        "the blocks' compute dtype (server/kv_dtype.py). Announced in the server's record: "
                        "clients with --require-full-precision avoid float16 caches beside float32 blocks")
    p.add_argument("--adapters", nargs="*", default=[],
                   help="PEFT LoRA adapters to pre-load, directories or hub ids from the local HF cache (announced; clients "
                        "choose one per session with active_adapter=<directory or repo name>; docs/FINETUNING.md)")
    p.add_argument("--max-train-mb", type=int, default=SERVER.max_train_request_bytes // MIB,
                   help="estimated memory one training request (Backward) may take, MiB; larger ones are refused")
    p.add_argument("--max-train-total-mb", type=int, default=SERVER.max_train_total_bytes // MIB,
                   help="estimated memory all training requests at once may take, MiB; more wait, then are refused")
    p.add_argument("--mmap-weights", action="store_true",
                   help="serve full-precision weights from the checkpoint file's mapping (pages shared by servers of "
                        "the same file on one host) instead of copying them into the process: less memory per "
                        "extra server, ~1.5x slower decode on the machine we measured")
    p.add_argument("--cache-mb", type=int, default=SERVER.cache_bytes // MIB,
                   help="attention-cache budget across sessions, MiB")
    p.add_argument("--publish-counters", action="store_true",
                   help="Info tells any caller the prefix cache's hits and the tokens computed (default: only in a "
                        "private swarm; a stranger watching them can guess other users' prompts)")
    p.add_argument("--prefix-cache-mb", type=int, default=SERVER.prefix_cache_bytes // MIB,
                   help="finished sessions' prefixes kept for later sessions, within --cache-mb, MiB (0 = off)")
    p.add_argument("--memory-mb", type=int,
                   help="memory for the blocks' weights as loaded (a GGUF's kept blocks: their bytes in the file) + "
                        "the attention cache (--cache-mb), MiB: blocks that do not fit are refused before loading; "
                        "with no --num-blocks, as many as fit (default: the memory available)")
    p.add_argument("--max-sessions", type=int, default=SERVER.max_sessions,
                   help="inference sessions open at once; more are refused (clients route around)")
    p.add_argument("--max-length", type=int, default=SERVER.max_length_tokens, help="longest session accepted, tokens")
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
    p.add_argument("--max-message-mb", type=int, default=SERVER.max_message_bytes // MIB,
                   help="largest gRPC message accepted, MiB")
    p.add_argument("--idle-timeout", type=float, default=SERVER.session_idle_timeout_s,
                   help="close sessions idle this long, seconds")
    p.add_argument("--frame-idle-timeout", type=float, default=SERVER.frame_idle_timeout_s,
                   help="close a framed connection this long after its last stream ended, seconds (clients keep one "
                        "for their next session)")
    # limits against greedy or hostile peers (docs/FAILURES.md); a peer is a remote host
    p.add_argument("--open-idle-timeout", type=float, default=SERVER.open_idle_timeout_s,
                   help="close a session whose first step has not come this long after its open, seconds, plus twice the "
                        "measured prefill of the blocks before its span (at most --idle-timeout)")
    p.add_argument("--resume-grace", type=float, default=SERVER.resume_grace_s,
                   help="close a session whose stream broke unless it is resumed (with its secret) this soon, seconds")
    p.add_argument("--max-sessions-per-peer", type=int, default=SERVER.max_sessions_per_peer,
                   help="open sessions one host may hold")
    p.add_argument("--max-concurrent-rpcs", type=int, default=SERVER.max_concurrent_rpcs,
                   help="gRPC calls at once (streams included)")
    p.add_argument("--rebalance-period", type=float, default=SERVER.rebalance_period_s,
                   help="with no --blocks: check every this many seconds whether moving helps the swarm (0 = never)")
    p.add_argument("--drain-timeout", type=float, default=SERVER.drain_timeout_s,
                   help="on SIGTERM, wait this long for sessions")


def run(args: argparse.Namespace) -> int:
    config = server_config(args)  # a bad path fails before the slow imports
    from swarmlm.server.server import run_server

    return run_server(config)


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        model_dir=model_ref(args), blocks=args.blocks,
        initial_peers=tuple(args.initial_peers), host=args.host, port=args.port, announce_host=args.announce_host,
        reachability=args.reachability, frames=args.frames, push_frames=args.push_frames,
        one_call_steps=args.one_call_steps, step_lane=args.step_lane,
        threads=args.threads, dtype=args.dtype, num_blocks=args.num_blocks, placement=args.placement,
        memory_bytes=args.memory_mb * MIB if args.memory_mb else None, cache_bytes=args.cache_mb * MIB,
        prefix_cache_bytes=args.prefix_cache_mb * MIB, publish_counters=args.publish_counters,
        max_sessions=args.max_sessions, max_length_tokens=args.max_length,
        scheduler=SchedulerConfig(
            max_batch_tokens=args.max_batch_tokens, max_prefill_skips=args.max_prefill_skips,
            batch_wait=replace(SCHEDULER.batch_wait, fraction=args.batch_wait),
            inline_decode_max_s=args.inline_decode_max_ms / 1000),
        session_idle_timeout_s=args.idle_timeout, frame_idle_timeout_s=args.frame_idle_timeout,
        open_idle_timeout_s=args.open_idle_timeout,
        resume_grace_s=args.resume_grace, max_sessions_per_peer=args.max_sessions_per_peer,
        max_concurrent_rpcs=args.max_concurrent_rpcs, max_message_bytes=args.max_message_mb * MIB,
        dht_prefix=args.dht_prefix,
        identity_file=args.identity, swarm_key=args.swarm_key, quant=args.quant, kv_dtype=args.kv_dtype,
        mmap_weights=args.mmap_weights, adapters=tuple(args.adapters), max_train_request_bytes=args.max_train_mb * MIB,
        max_train_total_bytes=args.max_train_total_mb * MIB,
        drain_timeout_s=args.drain_timeout, rebalance_period_s=args.rebalance_period,
    )
