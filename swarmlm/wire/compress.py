"""Hidden states on the wire in fewer bytes: float16 / bfloat16, or 8-bit blockwise.

    float32   4 bytes/value, exact
    float16   2 bytes/value, |error| <= 2^-11 |x| (relative rounding); values beyond fp16's range go as float32
    bfloat16  2 bytes/value, |error| <= 2^-8 |x|
    int8      1.0625 bytes/value: blocks of 64 consecutive values (row-major), each sent as int8 q = round(x / s)
              with s = absmax(block) / 127 (one float32 per block): |error| <= absmax(block) / 254

The client chooses per link and message (`ClientConfig.wire_dtype`). "auto" is float32 on every link: a client
that promises transformers' answers never rounds its hidden states unless its user asks (issue 39: a stranger's load
on a relay once drove a gateway's measured bandwidth down and its greedy answers wrong). "auto-lossy" (asked for)
keeps float32 (exact) on loopback addresses, on fast links (>= 500 Mbit/s measured, or not measured yet) and for messages whose float32 bytes cross
the link in under 1 ms at its measured rate (a decode step's few KB: compressing them saves less than that, while
packing and unpacking cost both ends ~0.1-0.5 ms here, benchmarks/wire_bench.py); otherwise float16 down to
50 Mbit/s, int8 below. A server answers in the format of the request it answers (int8 in, int8 out), so one choice
covers both directions of a hop.

The int8 format (wire/int8_block.py, which wire/codec.py decodes) is a `Tensor` message with dtype "int8_block64":
`shape` is the tensor's, `data` the per-block float32 scales followed by the int8 values; a peer's message is
checked (sizes, finite non-negative scales) before use, and decodes to float32.
"""
from __future__ import annotations

import torch

from swarmlm.config import WIRE_DTYPE_NAMES  # "auto", "auto-lossy" + the formats below
from swarmlm.wire import codec
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire.int8_block import BLOCK, INT8_BLOCK, PACKED, pack_int8, packed_bytes, unpack_int8  # noqa: F401

FAST_LINK_BPS = 500e6  # auto: at or above this, float32 (exact): the bytes saved cost less than the rounding
SLOW_LINK_BPS = 50e6  # auto: below this, int8; in between, float16
MIN_SAVING_S = 1e-3  # auto: a message whose float32 bytes take less than this on the link goes as float32
_FP16_MAX = 65504.0
_FLOAT_FORMATS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def check_wire_dtype(name: str) -> str:
    if name not in WIRE_DTYPE_NAMES:
        raise ValueError(f"wire_dtype must be one of {', '.join(WIRE_DTYPE_NAMES)}, got {name!r}")
    return name


def is_loopback(address: str) -> bool:
    """host:port on this machine's loopback (a busy machine's loopback can measure slow, and must stay exact).
    Only the usual loopback addresses: the netem testbed without namespaces emulates slow links on other 127.x
    addresses (swarmlm/bench/netem), and those are measured like any link."""
    host = address.rsplit(":", 1)[0].strip("[]").lower()
    return host in ("localhost", "::1", "127.0.0.1")


def choose(setting: str, bandwidth_bps: float, address: str = "", float32_bytes: int | None = None) -> str:
    """The format for one message (of `float32_bytes` as float32; None: a large one) on one link: the setting
    itself; for "auto" float32 (exact); for "auto-lossy" float32 on loopback, fast links and messages that cross the
    link fast anyway, else the link's measured bandwidth decides."""
    if check_wire_dtype(setting) not in ("auto", "auto-lossy"):
        return setting
    if setting == "auto":
        return "float32"
    if bandwidth_bps >= FAST_LINK_BPS or is_loopback(address):
        return "float32"
    if float32_bytes is not None and float32_bytes * 8 / bandwidth_bps < MIN_SAVING_S:
        return "float32"
    return "float16" if bandwidth_bps >= SLOW_LINK_BPS else "int8"


def bytes_per_value(wire_dtype: str) -> float:
    """What one hidden-state value costs on the wire in this format (the int8 format's scales included)."""
    return {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0, "int8": packed_bytes(BLOCK) / BLOCK}[wire_dtype]


def encode_hidden(hidden: torch.Tensor, wire_dtype: str) -> pb.Tensor:
    """Hidden states as a `Tensor` message in `wire_dtype` (float32 | float16 | bfloat16 | int8)."""
    if wire_dtype == "int8":
        return pack_int8(hidden)
    if wire_dtype == "float16" and hidden.abs().max() > _FP16_MAX:
        wire_dtype = "float32"  # out of fp16's range: exact rather than infinite
    dtype = _FLOAT_FORMATS.get(wire_dtype)
    if dtype is None:
        raise ValueError(f"cannot send hidden states as {wire_dtype!r}")
    return codec.encode(hidden if hidden.dtype == dtype else hidden.to(dtype))  # (a call saved right after a forward)


def encode_like(hidden: torch.Tensor, request_dtype: str) -> pb.Tensor:
    """A server's reply in the wire format of the request it answers (its `Tensor.dtype`)."""
    if request_dtype == INT8_BLOCK:
        return pack_int8(hidden)
    if request_dtype == "float16":
        return encode_hidden(hidden, "float16")
    return encode_hidden(hidden, request_dtype if request_dtype in ("float32", "bfloat16") else "float32")
