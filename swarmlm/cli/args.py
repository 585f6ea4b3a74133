"""Argument types shared by several commands."""
from __future__ import annotations

import argparse


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
