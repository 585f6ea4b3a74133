"""`swarmlm generate --model DIR --initial-peers ADDR (--prompt TEXT | --input-ids 1,2,3) --max-new-tokens N [--json]`"""
from __future__ import annotations

import argparse
import json

from swarmlm.cli.args import add_prefill_chunks, add_swarm_key


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text through the swarm")
    p.add_argument("--model", required=True, help="checkpoint directory (the client loads embeddings + head)")
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--servers", nargs="*", default=[], help="direct host:port list instead of a DHT")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--input-ids", help="comma-separated token ids")
    p.add_argument("--max-new-tokens", type=int, default=20)
    p.add_argument("--do-sample", action="store_true")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--routing", default="waiting-aware", choices=["shortest", "waiting-aware"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--push", action="store_true",
                   help="servers push each output straight to the next server of the route (N + 1 hops, not 2N)")
    add_prefill_chunks(p)
    add_swarm_key(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    from swarmlm.client.model import DistributedModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if args.prompt is not None:
        input_ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    else:
        try:
            input_ids = torch.tensor([[int(t) for t in args.input_ids.split(",")]])
        except ValueError:
            raise SystemExit(f"--input-ids must be comma-separated integers, got {args.input_ids!r}")
    model = DistributedModelForCausalLM.from_pretrained(
        args.model, initial_peers=args.initial_peers, servers=args.servers, routing=args.routing,
        threads=args.threads, push=args.push, prefill_chunk_tokens=args.prefill_chunks,
        swarm_key=args.swarm_key,
    )
    try:
        out = model.generate(
            input_ids, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, generator=torch.Generator().manual_seed(args.seed),
        )
    finally:
        model.close()
    new = out[0, input_ids.shape[1]:].tolist()
    text = tokenizer.decode(new, skip_special_tokens=True)
    stats = model.last_stats
    if args.json:
        print(json.dumps({
            "token_ids": new, "text": text, "ttft_s": stats.ttft_s, "tokens_per_s": stats.tokens_per_s,
            "total_s": stats.total_s, "route": stats.route, "prompt_tokens": stats.prompt_tokens,
        }))
    else:
        print(text)
        print(f"[route {' -> '.join(stats.route)} | ttft {stats.ttft_s:.3f} s | {stats.tokens_per_s:.1f} tokens/s]")
    return 0
