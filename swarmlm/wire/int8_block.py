"""The 8-bit blockwise wire format of hidden states (wire/compress.py chooses it, wire/codec.py decodes it): blocks of
64 consecutive values (row-major), each sent as int8 q = round(x / s) with s = absmax(block) / 127; a `Tensor` message
with dtype "int8_block64" whose `data` is the per-block float32 scales, then the int8 values."""
from __future__ import annotations

import math

import numpy as np
import torch

from swarmlm.errors import InvalidRequest
from swarmlm.wire import swarm_pb2 as pb

INT8_BLOCK = "int8_block64"
BLOCK = 64  # values per scale: smaller blocks track outliers better, each costs 4 bytes of scale
PACKED = {INT8_BLOCK: torch.float32}  # packed wire formats -> the dtype they decode to


def packed_bytes(count: int) -> int:
    return 4 * math.ceil(count / BLOCK) + count


def pack_int8(tensor: torch.Tensor) -> pb.Tensor:
    """Blockwise absmax int8 (see the module docstring)."""
    flat = tensor.detach().float().reshape(-1)
    count = flat.numel()
    pad = (-count) % BLOCK
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, BLOCK)  # [n, 64]
    scale = blocks.abs().amax(dim=1) / 127.0  # [n]
    q = torch.round(blocks / scale.clamp(min=1e-30)[:, None]).clamp_(-127, 127).to(torch.int8)
    data = scale.numpy().tobytes() + q.reshape(-1)[:count].numpy().tobytes()
    return pb.Tensor(data=data, dtype=INT8_BLOCK, shape=list(tensor.shape))


def unpack_int8(data: bytes, shape: tuple[int, ...], what: str = "tensor") -> torch.Tensor:
    """float32 tensor of `shape` from a peer's int8_block64 bytes, or InvalidRequest."""
    count = math.prod(shape)
    blocks = math.ceil(count / BLOCK)
    if len(data) != packed_bytes(count):
        raise InvalidRequest(f"{what}: {len(data)} bytes do not match shape {list(shape)} of {INT8_BLOCK} "
                             f"({packed_bytes(count)} bytes)")
    scale = torch.from_numpy(np.frombuffer(data, dtype=np.float32, count=blocks).copy())
    if not (torch.isfinite(scale).all() and (scale >= 0).all()):
        raise InvalidRequest(f"{what}: {INT8_BLOCK} scales must be finite and non-negative")
    q = torch.from_numpy(np.frombuffer(data, dtype=np.int8, offset=4 * blocks).copy()).float()
    q = torch.nn.functional.pad(q, (0, blocks * BLOCK - count)).view(blocks, BLOCK)
    return (q * scale[:, None]).reshape(-1)[:count].reshape(shape)
