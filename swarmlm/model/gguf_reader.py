"""The tensor table of a GGUF file, read in milliseconds: names, types, shapes and memory-mapped data.

gguf-py's GGUFReader builds a numpy view of every metadata element (a 49k-token vocabulary and its merges: ~100k
views, 5 to 20 s on a busy CPU) before it reaches the tensors. A server needs only the tensor table and
`general.architecture`, so this walks the metadata with struct and skips what it does not need. Layout
(little-endian, GGUF v2/v3): magic, version u32, tensor count u64, metadata count u64, metadata (key string, value
type u32, value), tensor infos (name string, dims count u32, dims u64 each, type u32, offset u64), then the data,
aligned to `general.alignment` (32 by default). Every length and offset is checked against the file's size.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}  # type -> struct
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: fastest-varying axis first (numpy's shape reversed)
    data: np.ndarray  # uint8 view of the file's mapping: rows x bytes per row (what gguf.dequantize takes)


class TableError(ValueError):
    pass


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise TableError(f"metadata runs past the end of the file (byte {self.pos})")
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise TableError(f"a string runs past the end of the file (byte {self.pos})")
        text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", "replace")
        self.pos += n
        return text

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.take("I"), self.take("Q")
            if item in _SCALARS:  # skipped whole: one jump
                self.pos += count * struct.calcsize(_SCALARS[item])
                return None
            for _ in range(count):
                self.value(item)
            return None
        if kind not in _SCALARS:
            raise TableError(f"unknown metadata value type {kind}")
        return self.take(_SCALARS[kind])


def read_table(path: Path) -> tuple[dict[str, object], dict[str, TensorInfo]]:
    """(scalar and string metadata, tensors by GGUF name) of a GGUF file; TableError if it is not one."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(memoryview(mapped))
    magic, version = cursor.take("4s"), cursor.take("I")
    if magic != b"GGUF" or version not in (2, 3):
        raise TableError(f"not a GGUF v2/v3 file (magic {magic!r}, version {version})")
    n_tensors, n_fields = cursor.take("Q"), cursor.take("Q")
    fields: dict[str, object] = {}
    for _ in range(n_fields):
        key, kind = cursor.string(), cursor.take("I")
        fields[key] = cursor.value(kind)
    infos = []
    for _ in range(n_tensors):
        name, n_dims = cursor.string(), cursor.take("I")
        dims = tuple(cursor.take("Q") for _ in range(n_dims))
        infos.append((name, dims, cursor.take("I"), cursor.take("Q")))
    alignment = int(fields.get("general.alignment") or 32)
    start = -(-cursor.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, dims, kind, offset in infos:
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise TableError(f"tensor {name} has unknown type {kind}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        row_bytes = dims[0] // block * type_size
        rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
        begin, end = start + offset, start + offset + rows * row_bytes
        if end > len(mapped):
            raise TableError(f"tensor {name} ends at byte {end}, past the end of the file ({len(mapped)} bytes)")
        data = mapped[begin:end].reshape(*reversed(dims[1:]), row_bytes)
        tensors[name] = TensorInfo(name, qtype, dims, data)
    return fields, tensors
