"""`swarmlm profile --model DIR [--blocks S:E] [--threads N]`: measure the per-block compute model alone."""
from __future__ import annotations

import argparse
import json


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure per-block prefill and decode times (what servers announce)")
    p.add_argument("--model", required=True)
    p.add_argument("--blocks", help="START:END (default: all blocks)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--refresh", action="store_true", help="measure again even if a cached profile exists")
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    import torch

    from swarmlm.server.server import profile_model
    from swarmlm.types import BlockRange

    torch.set_num_threads(args.threads)
    blocks = BlockRange.parse(args.blocks) if args.blocks else None
    prof = profile_model(args.model, blocks, args.dtype, args.threads, refresh=args.refresh)
    out = {"prefill_a_s": prof.prefill_a_s, "prefill_b_s": prof.prefill_b_s, "decode_s": prof.decode_s,
           "threads": args.threads, "dtype": args.dtype}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"per block: prefill = {prof.prefill_a_s * 1e3:.4f} ms/token * tokens + {prof.prefill_b_s * 1e3:.3f} ms;"
              f" decode = {prof.decode_s * 1e3:.3f} ms/token ({args.threads} threads, {args.dtype})")
    return 0
