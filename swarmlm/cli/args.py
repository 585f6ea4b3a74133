"""Argument types shared by several commands."""
from __future__ import annotations

import argparse


def prefill_chunks(text: str) -> int | None:
    """--prefill-chunks auto|off|TOKENS -> ClientConfig.prefill_chunk_tokens (None, 0 or TOKENS)."""
    from swarmlm.config import parse_prefill_chunks

    try:
        return parse_prefill_chunks(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_prefill_chunks(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-chunks", type=prefill_chunks, default=None, metavar="auto|off|TOKENS",
                   help="prompt tokens per prefill message (default auto: sized to the measured link and servers)")
