"""`swarmlm profile --model DIR|ORG/NAME [--blocks S:E] [--threads N]`: measure the per-block compute model alone."""
from __future__ import annotations

import argparse
import json

from swarmlm.cli.args import add_model, block_range, model_ref
from swarmlm.config import usable_cores


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure per-block prefill and decode times (what servers announce)")
    add_model(p, dht=False)
    p.add_argument("--blocks", type=block_range, help="START:END (default: all blocks)")
    p.add_argument("--threads", type=int, default=usable_cores(),
                   help="torch threads for compute (default: the cores this process may use, here %(default)s)")
    p.add_argument("--refresh", action="store_true", help="measure again even if a cached profile exists")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")


def run(args: argparse.Namespace) -> int:
    model = model_ref(args)  # a bad path fails before the slow imports
    import torch

    from swarmlm.server.server import profile_model

    torch.set_num_threads(args.threads)
    prof = profile_model(model, args.blocks, args.dtype, args.threads, refresh=args.refresh)
    out = {"prefill_a_s": prof.prefill_a_s, "prefill_b_s": prof.prefill_b_s, "decode_s": prof.decode_s,
           "decode_4rows_s": prof.decode_4rows_s, "decode_16rows_s": prof.decode_16rows_s,
           "threads": args.threads, "dtype": args.dtype}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"per block: prefill = {prof.prefill_a_s * 1e3:.4f} ms/token * tokens + {prof.prefill_b_s * 1e3:.3f} ms;"
              f" decode = {prof.decode_s * 1e3:.3f} ms/token ({args.threads} threads, {args.dtype}); with 4 / 16"
              f" sessions a step costs {prof.load_factor(4):.2f} / {prof.load_factor(16):.2f}x one session's")
    return 0
