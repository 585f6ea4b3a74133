"""Tensors <-> wire messages. Raw bytes + dtype + shape; every field a peer sends is checked before use."""
from __future__ import annotations

import functools
import math
import warnings

import numpy as np
import torch

from swarmlm.errors import InvalidRequest
from swarmlm.wire import int8_block
from swarmlm.wire import swarm_pb2 as pb

# dtype name -> (torch dtype, bytes per value)
WIRE_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "float32": (torch.float32, 4),
    "float16": (torch.float16, 2),
    "bfloat16": (torch.bfloat16, 2),
    "int64": (torch.int64, 8),
    "int32": (torch.int32, 4),
    "uint8": (torch.uint8, 1),
    "bool": (torch.bool, 1),
}
_NAMES = {dt: name for name, (dt, _) in WIRE_DTYPES.items()}
_NP_DTYPES = {name: np.dtype(np.bool_ if name == "bool" else name) for name in WIRE_DTYPES if name != "bfloat16"}
MAX_RANK = 4
MAX_KEPT_ZEROS = 1 << 16  # decode's finiteness check keeps its zeros for tensors up to this many values
# the finiteness check's infinity x 0 sets the FPU's "invalid" flag, which numpy reports as a RuntimeWarning: expected
# there (the check's answer), so not shown (a filter here rather than np.errstate, which costs more than the check)
warnings.filterwarnings("ignore", "invalid value encountered in dot", RuntimeWarning, __name__)


def encode(tensor: torch.Tensor) -> pb.Tensor:
    # (only the conversions a tensor needs: each torch call costs ~10x right after a forward, benchmarks/idle_cost.py;
    # numpy's tobytes lays out a strided view in C order itself)
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    name = _NAMES.get(tensor.dtype)
    if name is None:
        raise InvalidRequest(f"dtype {tensor.dtype} cannot be sent")
    # bfloat16 has no numpy twin: reinterpret its bits as int16 to get the raw bytes
    raw = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
    return pb.Tensor(data=raw.numpy().tobytes(), dtype=name, shape=tensor.shape)


def header(msg: pb.Tensor, what: str = "tensor", max_elements: int = 1 << 28) -> tuple[torch.dtype, tuple[int, ...]]:
    """dtype and shape from a peer's message, checked before its data is touched (nothing is allocated here)."""
    name = msg.dtype  # (each read of a message's field makes a new object: read once)
    if name not in WIRE_DTYPES and name not in int8_block.PACKED:
        raise InvalidRequest(f"{what}: unknown dtype {name[:40]!r}; expected one of "
                             f"{', '.join([*WIRE_DTYPES, *int8_block.PACKED])}")
    shape = tuple(msg.shape)
    if not 1 <= len(shape) <= MAX_RANK or min(shape) < 0 or max(shape) > max_elements:
        raise InvalidRequest(f"{what}: bad shape {list(shape)[:MAX_RANK + 1]}")
    # zero-sized dims count as 1: a zero-element tensor with absurd dims is refused here, not by numpy later
    if math.prod(shape) > max_elements or (0 in shape and math.prod(max(d, 1) for d in shape) > max_elements):
        raise InvalidRequest(f"{what}: shape {list(shape)} exceeds the limit of {max_elements} elements")
    if name in int8_block.PACKED:  # compressed hidden states (wire/int8_block.py): the dtype they decode to
        return int8_block.PACKED[name], shape
    return WIRE_DTYPES[name][0], shape


def decode(msg: pb.Tensor, what: str = "tensor", max_elements: int = 1 << 28, finite: bool = False) -> torch.Tensor:
    """A torch tensor from a peer's message, or InvalidRequest saying what is wrong with it. `finite`: refuse NaN
    and infinite values too."""
    _, shape = header(msg, what, max_elements)
    return decode_checked(msg, shape, what, finite)


def checked(msg: pb.Tensor, what: str = "tensor", max_elements: int = 1 << 28) -> tuple[int, ...]:
    """The shape of a peer's raw-dtype message after every check `decode` makes without its values (`finite`): the
    header and the data's length. (A client relaying a reply checks it so and sends its bytes on undecoded.)"""
    _, shape = header(msg, what, max_elements)
    name = msg.dtype
    if name not in WIRE_DTYPES:
        raise InvalidRequest(f"{what}: {name} is not a raw dtype")
    _sized(msg.data, shape, name, what)
    return shape


def decode_checked(msg: pb.Tensor, shape: tuple[int, ...], what: str = "tensor", finite: bool = False) -> torch.Tensor:
    """`decode` of a message whose header passed `header` already, which gave `shape` (a server's step checks its
    header against its limits first: read once, not again here)."""
    name = msg.dtype
    if name == int8_block.INT8_BLOCK:
        return _finite(int8_block.unpack_int8(msg.data, shape, what), what, finite)
    data = _sized(msg.data, shape, name, what)  # (each read of a bytes field copies it: read it once)
    if name == "bfloat16":
        array = np.frombuffer(data, dtype=np.int16).reshape(shape)
        return _finite(torch.from_numpy(array.copy()).view(torch.bfloat16), what, finite)
    return tensor_of(np.frombuffer(data, dtype=_NP_DTYPES[name]), shape, what, finite)


def _sized(data: bytes, shape: tuple[int, ...], name: str, what: str) -> bytes:
    """`data`, if its length is that of `shape` in the raw dtype `name`; else InvalidRequest saying so."""
    nbytes = math.prod(shape) * WIRE_DTYPES[name][1]
    if len(data) != nbytes:
        raise InvalidRequest(f"{what}: {len(data)} bytes do not match shape {list(shape)} of {name} ({nbytes} bytes)")
    return data


def tensor_of(array: np.ndarray, shape: tuple[int, ...], what: str = "tensor", finite: bool = False) -> torch.Tensor:
    """A torch tensor of `shape` from the flat `array` of a peer's bytes (its length checked already), or
    InvalidRequest if `finite` and a float value is NaN or infinite (a protobuf tensor's and a compact STEP's:
    wire/compact.py)."""
    count = array.size
    # checked with numpy, before the copy, in one call: a NaN or an infinity times zero is NaN, every finite value
    # times zero is 0, so the values' dot product with zeros is NaN exactly when one is not finite (a decode step's
    # checks run right after the server slept or computed, when every call costs ~10x: benchmarks/idle_cost.py)
    if finite and array.dtype.kind == "f" and count and math.isnan(array.dot(_zeros(array.dtype.str, count))):
        raise not_finite(what)
    # copy: frombuffer views the immutable message bytes, and torch wants writable memory (shaped by numpy: a torch
    # call saved)
    return torch.from_numpy(array.reshape(shape).copy())




def not_finite(what: str) -> InvalidRequest:
    """The refusal of a peer's tensor `what` holding a NaN or an infinity (every path that checks one says this)."""
    return InvalidRequest(f"{what}: contains NaN or infinite values")


def _finite(values: torch.Tensor, what: str, check: bool) -> torch.Tensor:
    """`values`, or InvalidRequest if `check` and any is NaN or infinite."""
    if check and not torch.isfinite(values).all():
        raise not_finite(what)
    return values


def _zeros(np_dtype: str, count: int) -> np.ndarray:
    """`count` zeros: kept for the sizes that recur (decode steps), new for a prefill's."""
    return _small_zeros(np_dtype, count) if count <= MAX_KEPT_ZEROS else np.zeros(count, dtype=np_dtype)


@functools.lru_cache(maxsize=64)  # the bound keeps odd sizes from piling up
def _small_zeros(np_dtype: str, count: int) -> np.ndarray:
    zeros = np.zeros(count, dtype=np_dtype)
    zeros.flags.writeable = False  # (shared by every call)
    return zeros


def all_ones(msg: pb.Tensor) -> bool:
    """Is this (header-checked) integer or bool tensor all ones? A byte comparison: the usual mask of a step without
    padding is recognised without decoding it."""
    if msg.dtype not in WIRE_DTYPES or msg.dtype.startswith(("float", "bfloat")):
        return False
    count = math.prod(msg.shape)
    dtype = _NP_DTYPES[msg.dtype].str
    ones = _small_ones(dtype, count) if count <= 1024 else np.ones(count, dtype=dtype).tobytes()
    return msg.data == ones


@functools.lru_cache(maxsize=64)  # only small masks recur (decode steps); the bound keeps odd shapes from piling up
def _small_ones(dtype: str, count: int) -> bytes:
    return np.ones(count, dtype=dtype).tobytes()


def is_set(msg: pb.Tensor) -> bool:
    return bool(msg.dtype) or len(msg.shape) > 0
