"""`swarmlm model init --preset NAME --out DIR [--seed S] [--dtype float32|bfloat16]`"""
from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("model", help="create model checkpoints")
    verbs = p.add_subparsers(dest="model_verb", required=True)
    init = verbs.add_parser("init", help="write a randomly initialised checkpoint with a real architecture")
    from swarmlm.model.presets import PRESETS

    init.add_argument("--preset", required=True, choices=sorted(PRESETS))
    init.add_argument("--out", required=True, help="directory to write (config.json, safetensors, tokenizer)")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    init.add_argument("--max-shard-size", default="1GB")
    init.add_argument("--layers", type=int, help="override the preset's number of blocks")


def run(args: argparse.Namespace) -> int:
    from swarmlm.model.checkpoint import parse_dtype
    from swarmlm.model.random_checkpoint import init_checkpoint

    out = init_checkpoint(args.preset, args.out, seed=args.seed, dtype=parse_dtype(args.dtype),
                          max_shard_size=args.max_shard_size, num_layers=args.layers)
    print(out)
    return 0
