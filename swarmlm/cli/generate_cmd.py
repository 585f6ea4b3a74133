"""`swarmlm generate --model DIR|ORG/NAME --initial-peers ADDR (--prompt TEXT | --input-ids 1,2,3) --max-new-tokens N
[--json]`: transformers' generate() through the swarm; the text streams to stdout as it is generated."""
from __future__ import annotations

import argparse
import json

from swarmlm.cli.args import (add_client_precision, add_model, add_prefill_chunks, add_push, add_speculative, add_swarm_key,
                              model_ref)


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text through the swarm")
    add_model(p)  # the client loads embeddings, norms and head only
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--servers", nargs="*", default=[], help="direct host:port list instead of a DHT")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--input-ids", help="comma-separated token ids")
    p.add_argument("--max-new-tokens", type=int, default=20)
    # unset options take the checkpoint's generation_config.json, as transformers' generate() does
    p.add_argument("--do-sample", action="store_true", default=None)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--repetition-penalty", type=float)
    p.add_argument("--stop", action="append", metavar="TEXT", help="stop when the output contains TEXT (repeatable)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--wait-for-blocks", type=float, default=30.0, metavar="SECONDS",
                   help="how long to wait for servers of missing blocks before giving up")
    p.add_argument("--routing", default="waiting-aware", choices=["shortest", "waiting-aware"])
    p.add_argument("--threads", type=int, default=1)
    add_push(p)
    add_speculative(p)
    p.add_argument("--draft-model", metavar="DIR|ORG/NAME",
                   help="with --speculative: draft with this small local model (same tokenizer) instead of prompt "
                        "lookup")
    add_prefill_chunks(p)
    add_swarm_key(p)
    add_client_precision(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (no streaming)")


def run(args: argparse.Namespace) -> int:
    import sys

    model_name = model_ref(args)  # a bad path fails before the slow imports
    import torch
    from transformers import TextStreamer

    from swarmlm.client.model import DistributedModelForCausalLM
    from swarmlm.model.checkpoint import load_tokenizer

    tokenizer = load_tokenizer(model_name)
    if args.prompt is not None:
        input_ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    else:
        try:
            input_ids = torch.tensor([[int(t) for t in args.input_ids.split(",")]])
        except ValueError:
            raise ValueError(f"--input-ids must be comma-separated integers, got {args.input_ids!r}") from None
    model = DistributedModelForCausalLM.from_pretrained(
        model_name, initial_peers=args.initial_peers, servers=args.servers, dtype=args.dtype,
        dht_prefix=args.dht_prefix, routing=args.routing, threads=args.threads, push=args.push,
        prefill_chunk_tokens=args.prefill_chunks, wait_for_blocks_s=args.wait_for_blocks,
        swarm_key=args.swarm_key, quant=args.quant, require_full_precision=args.require_full_precision,
        wire_dtype=args.wire_dtype,
    )
    options = {k: v for k, v in {"do_sample": args.do_sample, "temperature": args.temperature, "top_k": args.top_k,
                                 "top_p": args.top_p, "repetition_penalty": args.repetition_penalty,
                                 "stop_strings": args.stop}.items() if v is not None}
    streamer = None if args.json else TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    try:
        draft = None
        if args.draft_model:
            from transformers import AutoModelForCausalLM

            draft = AutoModelForCausalLM.from_pretrained(args.draft_model)
        out = model.generate(input_ids, max_new_tokens=args.max_new_tokens, tokenizer=tokenizer, streamer=streamer,
                             generator=torch.Generator().manual_seed(args.seed), speculative=args.speculative,
                             draft_model=draft, **options)
    finally:
        model.close()
    new = out[0, input_ids.shape[1]:].tolist()
    stats = model.last_stats
    if args.json:
        print(json.dumps({
            "token_ids": new, "text": tokenizer.decode(new, skip_special_tokens=True), "ttft_s": stats.ttft_s,
            "tokens_per_s": stats.tokens_per_s, "total_s": stats.total_s, "route": stats.route,
            "prompt_tokens": stats.prompt_tokens, "speculation": stats.speculation,
        }))
    else:
        print(f"[route {' -> '.join(stats.route)} | ttft {stats.ttft_s:.3f} s | {stats.tokens_per_s:.1f} tokens/s]",
              file=sys.stderr)
    return 0
