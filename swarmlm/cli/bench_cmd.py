"""`swarmlm bench (--model DIR | --preset NAME) --servers 1,2,4 --strategies sequential,pipelined,microbatched
--prompts FILE|builtin [--limit N] [--max-new-tokens T] [--network lan|wan|FILE] [--out DIR]`"""
from __future__ import annotations

import argparse

from swarmlm.cli.args import add_prefill_chunks, add_push, add_speculative, model_ref
from swarmlm.config import DTYPE_NAMES, QUANT_NAMES, WIRE_DTYPE_NAMES


def _ints(text: str) -> tuple[int, ...]:
    """'1,2,4' or '1-6' or '1-3,6' -> (1, 2, 4) ..."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    return tuple(out)


def _micro_batches(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def strategy_configs(text: str, in_flight: int | None, micro_batches: int | str | None, **common) -> tuple:
    """'sequential,pipelined:3,microbatched:auto' -> StrategyConfigs; a :VALUE overrides the flag for its entry."""
    from swarmlm.bench.strategies import StrategyConfig

    out = []
    for token in (t.strip() for t in text.split(",") if t.strip()):
        name, _, value = token.partition(":")
        k = int(value) if value and name == "pipelined" else (in_flight if name == "pipelined" else None)
        m = (_micro_batches(value) if value else micro_batches) if name == "microbatched" else None
        if value and name not in ("pipelined", "microbatched"):
            raise ValueError(f"{name} takes no :VALUE (got {token!r})")
        out.append(StrategyConfig(name, in_flight=k, micro_batches=m, **common))
    return tuple(out)


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="the scaling study: N servers x execution strategies, measured and reported")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="DIR|FILE.gguf|NAME|ORG/NAME",
                     help="checkpoint directory, GGUF file, catalog model (smollm2-135m-instruct) or hub id")
    src.add_argument("--preset", help="a model preset (e.g. bloomz-560m): a random-weight checkpoint, cached")
    p.add_argument("--revision", help="with a hub id: branch, tag or commit (default main)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_NAMES,
                   help="weights and compute on servers and client (default auto: the checkpoint's own)")
    p.add_argument("--servers", type=_ints, default=(1, 2, 4), help="swarm sizes, e.g. 1,2,4 or 1-6")
    p.add_argument("--strategies", default="sequential,pipelined,microbatched",
                   help="comma-separated; NAME:VALUE sets pipelined's K or microbatched's M for that entry, "
                        "e.g. microbatched:4 or microbatched:auto (MoLink's micro-batch rule)")
    p.add_argument("--prompts", default="builtin", help="'builtin', a text file (one per line) or JSONL")
    p.add_argument("--limit", type=int, help="use the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=10, help="per prompt unless the JSONL says otherwise")
    p.add_argument("--poisson-rate", type=float, help="open loop: Poisson arrivals at this many requests/s")
    p.add_argument("--in-flight", type=int, help="pipelined: K sessions at once (default: servers in the route)")
    p.add_argument("--micro-batches", type=_micro_batches,
                   help="microbatched: M micro-batches, or 'auto' for MoLink's rule (default: servers in the route)")
    p.add_argument("--micro-batch-size", type=int, default=2, help="microbatched: prompts per micro-batch")
    p.add_argument("--full-prefill-head", action="store_true",
                   help="run the LM head on every prompt position (the client's step_logits) instead of the last")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens")
    p.add_argument("--network", default="loopback", help="loopback | lan | wan | a topology file")
    p.add_argument("--netem-mode", default="auto", choices=["auto", "namespaces", "relay-only"],
                   help="how links are emulated: network namespaces (needs root), a userspace relay, or auto")
    add_push(p)
    add_speculative(p)
    add_prefill_chunks(p)
    p.add_argument("--server-threads", type=int, default=1, help="torch threads per server")
    p.add_argument("--quant", default="auto", choices=QUANT_NAMES,
                   help="weights of the servers' blocks and the client's head + embeddings (model/quant.py)")
    p.add_argument("--wire-dtype", default="auto", choices=WIRE_DTYPE_NAMES,
                   help="hidden states on the wire (wire/compress.py); auto: float32 on fast links, smaller on slow")
    p.add_argument("--client-threads", type=int, default=1, help="torch threads of the client")
    p.add_argument("--out", default="bench-out", help="results directory")
    p.add_argument("--title", help="report title")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from swarmlm.bench import report
    from swarmlm.bench.runner import BenchConfig, run_bench
    from swarmlm.bench.workload import poisson_arrivals, prompt_source, tokenize
    from swarmlm.model.checkpoint import load_tokenizer

    if args.preset:
        from swarmlm.model.random_checkpoint import default_checkpoint

        model_dir = str(default_checkpoint(args.preset))
    else:
        model_dir = model_ref(args)
    strategies = strategy_configs(args.strategies, args.in_flight, args.micro_batches,
                                  micro_batch_size=args.micro_batch_size, head_last_only=not args.full_prefill_head,
                                  ignore_eos=args.ignore_eos, speculative=args.speculative)
    config = BenchConfig(model_dir=model_dir, servers=args.servers, strategies=strategies, network=args.network,
                         netem_mode=args.netem_mode, server_threads=args.server_threads,
                         client_threads=args.client_threads, log_dir=f"{args.out}/logs", push=args.push,
                         prefill_chunk_tokens=args.prefill_chunks, quant=args.quant, wire_dtype=args.wire_dtype,
                         dtype=args.dtype)
    tokenizer = load_tokenizer(model_dir)
    requests = tokenize(prompt_source(args.prompts), tokenizer, args.max_new_tokens, args.limit)
    if args.poisson_rate:
        requests = poisson_arrivals(requests, args.poisson_rate)
    title = args.title or f"swarmlm bench: {model_dir.rstrip('/').split('/')[-1]}, {args.network}"
    notes = {"prompts": args.prompts, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
             "poisson_rate": args.poisson_rate, "mean_input_tokens": sum(len(r.input_ids) for r in requests)
             / len(requests)}
    console = Console(stderr=True)
    total = len(config.servers) * len(strategies) * len(requests)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, refresh_per_second=2) as bar:
        task = bar.add_task("starting", total=total)

        def progress(description: str, done: int) -> None:
            bar.update(task, description=description, advance=done)

        def checkpoint(result) -> None:  # results so far survive an interrupted run
            report.write_results(args.out, config, result.runs, result.telemetry, notes)
            last = result.runs[-len(strategies):]
            for r in last:
                bar.console.log(f"N={r['servers']} {r['strategy_label']}: {r['throughput_tokens_per_s']:.2f} tok/s, "
                                f"mean response {r['mean_response_s']:.2f} s, failed {r['failed']}")

        result = run_bench(config, requests, progress, checkpoint)
    report.write_results(args.out, config, result.runs, result.telemetry, notes)
    report.plot_all(args.out, result.runs, result.telemetry, title)
    path = report.write_report(args.out, result.runs, title)
    console.print(f"wrote {path}")
    return 0 if all(r["failed"] == 0 for r in result.runs) else 1
