"""`swarmlm generate --model DIR|NAME|ORG/NAME --initial-peers ADDR [--prompt TEXT | --input-ids 1,2,3] [--raw]
--max-new-tokens N [--json]`: transformers' generate() through the swarm; the text streams to stdout as it is
generated. A model with a chat template gets the prompt as one user message (`--raw`: the plain text); with neither
--prompt nor --input-ids the prompt is read from a pipe on stdin."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from swarmlm.cli.args import (add_adapter, add_client_precision, add_model, add_prefill_chunks, add_push,
                              add_speculative, add_swarm_key, add_waits, model_ref)
from swarmlm.types import describe_spans

# --help lists these first ("common options"), the rest under "advanced options"
COMMON = ("--model", "--initial-peers", "--servers", "--adapter", "--prompt", "--input-ids", "--raw",
          "--max-new-tokens", "--do-sample", "--temperature", "--json")


def add_client(p: argparse.ArgumentParser) -> None:
    """The flags of a client of the swarm (generate, chat): where the swarm is and how to reach it."""
    add_model(p)  # the client loads embeddings, norms and head only
    add_adapter(p)
    p.add_argument("--initial-peers", nargs="*", default=[], metavar="ADDR",
                   help="DHT multiaddrs (printed by `swarmlm dht`)")
    p.add_argument("--servers", nargs="*", default=[], metavar="HOST:PORT",
                   help="direct host:port list instead of a DHT")
    add_waits(p)
    p.add_argument("--routing", default="waiting-aware", choices=["shortest", "waiting-aware"],
                   help="how the route through the servers is chosen")
    p.add_argument("--threads", type=int, default=1, help="torch threads for the client's embeddings and head")
    add_push(p)
    add_prefill_chunks(p)
    add_swarm_key(p)
    add_client_precision(p)


def add_sampling(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """Sampling flags; unset ones take the checkpoint's generation_config.json, as transformers' generate() does."""
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="tokens to generate at most")
    p.add_argument("--do-sample", action="store_true", default=None,
                   help="sample (default: the checkpoint's generation config, else greedy)")
    p.add_argument("--temperature", type=float, help="sampling temperature (default: the checkpoint's)")
    p.add_argument("--top-k", type=int, help="sample among the K likeliest tokens (default: the checkpoint's)")
    p.add_argument("--top-p", type=float, help="nucleus sampling threshold (default: the checkpoint's)")
    p.add_argument("--repetition-penalty", type=float, help="(default: the checkpoint's)")
    p.add_argument("--stop", action="append", metavar="TEXT", help="stop when the output contains TEXT (repeatable)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text through the swarm")
    add_client(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="the prompt (default: read from stdin when it is a pipe)")
    src.add_argument("--input-ids", help="comma-separated token ids")
    p.add_argument("--raw", action="store_true",
                   help="give the prompt as plain text, not through the model's chat template")
    add_sampling(p, max_new_tokens=20)
    add_speculative(p)
    p.add_argument("--draft-model", metavar="DIR|ORG/NAME",
                   help="with --speculative: draft with this small local model (same tokenizer) instead of prompt "
                        "lookup")
    p.add_argument("--json", action="store_true", help="print one JSON object (no streaming)")


def sampling_options(args: argparse.Namespace) -> dict:
    return {k: v for k, v in {"do_sample": args.do_sample, "temperature": args.temperature, "top_k": args.top_k,
                              "top_p": args.top_p, "repetition_penalty": args.repetition_penalty,
                              "stop_strings": args.stop}.items() if v is not None}


def connect(args: argparse.Namespace, model_name: str):
    """The DistributedModelForCausalLM the client flags describe."""
    from swarmlm.client.model import DistributedModelForCausalLM

    return DistributedModelForCausalLM.from_pretrained(
        model_name, initial_peers=args.initial_peers, servers=args.servers, dtype=args.dtype,
        dht_prefix=args.dht_prefix, routing=args.routing, threads=args.threads, push=args.push,
        prefill_chunk_tokens=args.prefill_chunks, wait_for_blocks_s=args.wait_for_blocks,
        wait_for_loading_s=args.wait_for_loading,
        swarm_key=args.swarm_key, quant=args.quant, require_full_precision=args.require_full_precision,
        wire_dtype=args.wire_dtype, adapter=args.adapter,
    )


def stdin_prompt(verb: str) -> str:
    """The prompt piped on stdin (a terminal on stdin is not a prompt: the user gets told what to pass)."""
    if sys.stdin is None or sys.stdin.isatty():
        raise ValueError(f"give --prompt TEXT or --input-ids IDS, or pipe the prompt: echo TEXT | swarmlm {verb} ...")
    text = sys.stdin.read().strip()
    if not text:
        raise ValueError("the prompt read from stdin is empty")
    return text


def _input_ids(args: argparse.Namespace, tokenizer):
    import torch

    from swarmlm.api.prompts import encode_chat

    if args.input_ids is not None:
        try:
            return torch.tensor([[int(t) for t in args.input_ids.split(",")]])
        except ValueError:
            raise ValueError(f"--input-ids must be comma-separated integers, got {args.input_ids!r}") from None
    prompt = args.prompt if args.prompt is not None else stdin_prompt("generate")
    if args.raw or not getattr(tokenizer, "chat_template", None):
        return tokenizer(prompt, return_tensors="pt").input_ids
    print("swarmlm generate: the prompt goes through the model's chat template as one user message "
          "(--raw: as plain text)", file=sys.stderr)
    return torch.tensor([encode_chat(tokenizer, [("user", prompt)])])


def run(args: argparse.Namespace) -> int:
    model_name = model_ref(args)  # a bad path fails before the slow imports
    import torch
    from transformers import TextStreamer

    from swarmlm.model.checkpoint import load_tokenizer

    tokenizer = load_tokenizer(model_name)
    input_ids = _input_ids(args, tokenizer)
    model = connect(args, model_name)
    streamer = None if args.json else TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    try:
        draft = None
        if args.draft_model:
            from transformers import AutoModelForCausalLM

            draft = AutoModelForCausalLM.from_pretrained(args.draft_model)
        out = model.generate(input_ids, max_new_tokens=args.max_new_tokens, tokenizer=tokenizer, streamer=streamer,
                             generator=torch.Generator().manual_seed(args.seed), speculative=args.speculative,
                             draft_model=draft, **sampling_options(args))
    finally:
        model.close()
    new = out[0, input_ids.shape[1]:].tolist()
    stats = model.last_stats
    if args.json:
        print(json.dumps({
            "token_ids": new, "text": tokenizer.decode(new, skip_special_tokens=True), "ttft_s": stats.ttft_s,
            "tokens_per_s": stats.tokens_per_s, "total_s": stats.total_s,
            "route": [dataclasses.asdict(s) for s in stats.route],
            "prompt_tokens": stats.prompt_tokens, "speculation": stats.speculation,
        }))
    else:
        print(f"[route {describe_spans(stats.route)} | ttft {stats.ttft_s:.3f} s | {stats.tokens_per_s:.1f} tokens/s]",
              file=sys.stderr)
    return 0
