"""`swarmlm demo [--servers N] [--preset NAME]`: a local swarm, a few generations, and the same model run locally."""
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
    p = sub.add_parser("demo", help="start a local swarm, generate through it, compare with a local run")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--preset", default="bloomz-560m")
    p.add_argument("--model", help="use this checkpoint instead of a cached random one of --preset")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch threads per server and for the client")
    p.add_argument("--api", action="store_true",
                   help="then keep the swarm up behind the OpenAI-compatible gateway (swarmlm api) until Ctrl-C")
    p.add_argument("--api-port", type=int, default=8000)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from swarmlm.client.model import DistributedModelForCausalLM
    from swarmlm.model.checkpoint import load_config
    from swarmlm.model.random_checkpoint import default_checkpoint
    from swarmlm.swarm.local import LocalSwarm, even_split

    console = Console()
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the swarm as Ctrl-C does (never leaves servers behind)
    hf_logging.disable_progress_bar()  # our own status lines say what is loading
    torch.set_num_threads(args.threads)
    with console.status(f"preparing the {args.preset} checkpoint (cached after the first run)"):
        model_dir = args.model or str(default_checkpoint(args.preset))
    num_blocks = int(load_config(model_dir).num_hidden_layers)
    ranges = even_split(num_blocks, args.servers)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
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
            local = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        table = Table(title=f"{args.preset}: swarm of {args.servers} vs one process ({args.max_new_tokens} new tokens)")
        for col in ("prompt", "TTFT s", "swarm tok/s", "local tok/s", "same tokens"):
            table.add_column(col)
        routes = set()
        for prompt in DEMO_PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=args.max_new_tokens)
            stats = model.last_stats
            t1 = time.perf_counter()
            with torch.inference_mode():
                want = local.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
            local_s = time.perf_counter() - t1
            n = out.shape[1] - ids.shape[1]
            same = torch.equal(out, want)
            console.print(f"[bold]{prompt}[/bold] -> {tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)!r}")
            routes.add(" -> ".join(f"{r.split('[')[0][-8:]}[{r.split('[')[1]}" for r in stats.route))
            table.add_row(prompt, f"{stats.ttft_s:.3f}", f"{stats.tokens_per_s:.1f}", f"{n / local_s:.1f}",
                          "yes" if same else "[red]NO[/red]")
        console.print(table)
        for route in sorted(routes):
            console.print(f"route (server id suffix[blocks]): {route}")
        console.print("random weights: the text is noise; what matters is that the swarm gives the local model's tokens")
        model.close()
        if args.api:
            serve_api(console, model_dir, swarm.initial_peers, args.api_port, args.threads)
        else:
            console.print("serve it: [bold]swarmlm demo --api[/bold] keeps this swarm up behind an OpenAI-compatible "
                          "API, a chat page and a monitor page (docs/API.md)", soft_wrap=True)
    except KeyboardInterrupt:
        console.print("interrupted: stopping the swarm")
        return 130
    finally:
        swarm.stop()
    return 0


def serve_api(console, model_dir: str, initial_peers: list[str], port: int, threads: int) -> None:
    """The gateway on the demo swarm until Ctrl-C, with the commands to try it."""
    import time

    from swarmlm.api.process import GatewayProcess

    with console.status("starting the API gateway"):
        gateway = GatewayProcess(model_dir, initial_peers, extra=["--port", str(port)], threads=threads).start()
    try:
        url = gateway.url
        console.print(f"OpenAI-compatible API: {url}/v1   chat: {url}/chat   monitor: {url}/   "
                      "(Ctrl-C stops everything)", soft_wrap=True)
        console.print(f"""curl -s {url}/v1/completions -H 'Content-Type: application/json' -d '{{"model": "{model_dir}", \
  "prompt": "What is the capital of France?", "max_tokens": 16, "temperature": 0}}'""", soft_wrap=True, markup=False)
        console.print(f"swarmlm status --initial-peers {initial_peers[0]} --model {model_dir}", soft_wrap=True,
                      markup=False)
        while gateway.proc is not None and gateway.proc.poll() is None:
            time.sleep(1)
    finally:
        gateway.stop()
