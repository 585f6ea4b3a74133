"""Argument types shared by several commands."""
from __future__ import annotations

import argparse

from swarmlm.config import ClientConfig
from swarmlm.perf.speculation import parse_mode

CLIENT = ClientConfig()  # the client flags' defaults: each setting's one definition is its config field


def prefill_chunks(text: str) -> int | None:
    """--prefill-chunks auto|off|TOKENS -> ClientConfig.prefill_chunk_tokens (None: sized to the link and the
    servers, 0: one message, or tokens per chunk)."""
    if text in ("auto", "off"):
        return None if text == "auto" else 0
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(
            f"--prefill-chunks must be 'auto', 'off' or a positive number of tokens, got {text!r}")
    return int(text)


def add_prefill_chunks(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-chunks", type=prefill_chunks, default=None, metavar="auto|off|TOKENS",
                   help="prompt tokens per prefill message (default auto: sized to the measured link and servers)")


def add_push(p: argparse.ArgumentParser) -> None:
    """--push auto|on|off -> ClientConfig.push (server-to-server push; auto: where the measured RTTs say it pays)."""
    p.add_argument("--push", default=CLIENT.push, choices=["auto", "on", "off"],
                   help="servers push each output straight to the next server of the route (N + 1 links per token, "
                        "not 2N); auto (default): on routes where the measured RTTs say it saves time")


def speculative(text: str) -> str:
    """--speculative off|auto|K, checked by perf/speculation.parse_mode (as everywhere it is used)."""
    try:
        parse_mode(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--speculative: {exc}") from None
    return text


def add_speculative(p: argparse.ArgumentParser, default: str = "off") -> None:
    p.add_argument("--speculative", type=speculative, default=default, metavar="off|auto|K",
                   help="speculative decoding (one sequence at a time): drafts by prompt lookup, verified by the "
                        "swarm in one pass; auto: the draft length from the measured acceptance and the route's "
                        "cost (0 where it does not pay), K: always K drafts (default %(default)s)")


def add_waits(p: argparse.ArgumentParser) -> None:
    """--wait-for-blocks / --wait-for-loading -> ClientConfig.wait_for_blocks_s / wait_for_loading_s."""
    p.add_argument("--wait-for-blocks", type=float, default=CLIENT.wait_for_blocks_s, metavar="SECONDS",
                   help="how long to wait for servers of missing blocks before giving up (the gateway: a 503)")
    p.add_argument("--wait-for-loading", type=float, default=CLIENT.wait_for_loading_s, metavar="SECONDS",
                   help="while servers announce every missing block as loading (a spare moving onto them), wait up "
                        "to this long in all")


SWARM_KEY_ENV = "SWARMLM_SWARM_KEY_FILE"


def swarm_key_file(path: str) -> bytes | None:
    """--swarm-key FILE -> the key's bytes (swarm/private.py); an empty value means an open swarm."""
    if not path:
        return None
    from swarmlm.swarm.private import load_swarm_key

    try:
        return load_swarm_key(path)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_swarm_key(p: argparse.ArgumentParser) -> None:
    """The private-swarm flag of every verb that talks to the swarm (dest: args.swarm_key, bytes or None)."""
    import os

    p.add_argument("--swarm-key", type=swarm_key_file, default=os.environ.get(SWARM_KEY_ENV), metavar="FILE",
                   help=f"a private swarm's shared key (default: ${SWARM_KEY_ENV}; none = an open swarm). "
                        "`swarmlm dht --new-swarm-key FILE` creates one")


def add_dtype(p: argparse.ArgumentParser, what: str = "weights and compute") -> None:
    """--dtype: `what` runs in it."""
    from swarmlm.config import DTYPE_NAMES

    p.add_argument("--dtype", default="auto", choices=DTYPE_NAMES,
                   help=f"{what}: {', '.join(DTYPE_NAMES)} (default auto: the checkpoint's own; on a CPU float16 "
                        "runs as float32, and bfloat16 too unless the CPU has AMX bf16 units). From Python, "
                        "from_pretrained(dtype=) also takes torch.float32 etc., as transformers does")


def add_model(p: argparse.ArgumentParser, required: bool = True, dht: bool = True) -> None:
    """The model flags of every verb that loads one: --model (directory or hub id), --revision, --dtype, and
    --dht-prefix for the verbs that join a swarm."""
    p.add_argument("--model", required=required, metavar="DIR|FILE.gguf|NAME|ORG/NAME",
                   help="checkpoint directory, GGUF file, a catalog model (smollm2-135m-instruct: fetched once), or "
                        "hub id (from the local Hugging Face cache, else downloaded)")
    p.add_argument("--revision", help="with a hub id: branch, tag or commit (default main)")
    p.add_argument("--gguf-file", help="with a hub id: the GGUF file of its snapshot to use")
    add_dtype(p)
    if dht:
        p.add_argument("--dht-prefix", help="DHT namespace (default: the model's identity, the same for every copy)")


def model_ref(args: argparse.Namespace) -> str:
    """--model with --revision folded in (`org/name@revision`), as every loader takes it; a path that is not a
    directory fails here, before the slow imports."""
    from pathlib import Path

    path = Path(args.model).expanduser()
    looks_like_path = args.model.startswith((".", "/", "~")) or path.exists()
    if looks_like_path and not path.is_dir() and not (path.is_file() and path.suffix.lower() == ".gguf"):
        raise FileNotFoundError(f"{args.model}: not a checkpoint directory")
    if not looks_like_path:  # a typo or an unreachable hub is one line now, before the slow imports
        from swarmlm.model.catalog import CATALOG
        from swarmlm.model.source import resolve

        if args.model not in CATALOG:  # a hub id: its config, from the cache or the hub if it can be reached
            resolve(args.model, getattr(args, "revision", None)).file("config.json")
    if getattr(args, "gguf_file", None):
        from swarmlm.model.source import gguf_in_snapshot

        return gguf_in_snapshot(args.model, args.gguf_file, getattr(args, "revision", None))
    if getattr(args, "revision", None) is None:
        return args.model
    if path.is_dir():
        raise ValueError(f"--revision applies to hub ids, but {args.model} is a local directory")
    return f"{args.model}@{args.revision}"


def block_range(text: str):
    """--blocks START:END -> BlockRange (checked by argparse: a bad range fails before anything loads)."""
    from swarmlm.types import BlockRange

    try:
        return BlockRange.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_client_precision(p: argparse.ArgumentParser) -> None:
    """--quant, --require-full-precision, --wire-dtype: what a client (generate, api) computes and sends in."""
    from swarmlm.config import QUANT_NAMES, WIRE_DTYPE_NAMES

    p.add_argument("--quant", default="auto", choices=QUANT_NAMES,
                   help="the client's LM head and embeddings: auto = a GGUF's own blocks; none = dequantized; "
                        "int8 / int4 = quantized in blocks of 32 (swarmlm/model/quant.py)")
    p.add_argument("--require-full-precision", action="store_true",
                   help="route only through servers that announce full-precision weights (quant none) and caches "
                        "of their blocks' dtype (not --kv-dtype float16 beside float32 blocks)")
    p.add_argument("--wire-dtype", default="auto", choices=WIRE_DTYPE_NAMES,
                   help="hidden states on the wire (wire/compress.py); auto: float32 (exact) on every link; "
                        "auto-lossy: float32 on fast links, float16 or int8 on slow ones (answers may change)")


def add_adapter(p: argparse.ArgumentParser) -> None:
    """--adapter: a tuned model (client/tuning.py, docs/FINETUNING.md "Tuned models")."""
    p.add_argument("--adapter", metavar="DIR|NAME",
                   help="a tuned model: a folder saved by save_adapter (a soft prompt runs here; a LoRA on the "
                        "servers that pre-load it with --adapters), or the name of an adapter servers pre-load")
