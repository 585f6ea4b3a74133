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
