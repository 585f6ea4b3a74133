"""Weights kept in a GGUF file's own quantized blocks, and the linear layers and embeddings that compute from them.

A `PackedLinear` holds its weight as the file holds it: `out_features` rows of `row_bytes` bytes each (GGUF
quantizes along the input axis, so a row of blocks is one output feature, and a row permutation -- transformers'
Llama q/k reordering, BLOOM's fused qkv -- is applied to whole rows without touching a block). Its product is
`swarmlm/kernels/packed.c`: each block unpacked to float32 in registers and multiplied by float32 activations, so the
layer equals `nn.Linear` over the dequantized weight to float32 summation order -- except Q4_0, Q4_1, Q8_0 and the
K-quants, whose products first round the activations to int16 per block of 32 (`swarmlm/kernels/act16.c`: integer products where
the vector unit has them, Q4_0 / Q4_1 at 8+ rows on AMX tiles where the CPU has them, `amx.c`: the same integer sums;
~3e-5 relative error, the same on every build and batch shape).

How a call runs, by the number of activation rows R (tokens x sequences):
- R <= DIRECT_ROWS (decode, small batches, speculative passes): the kernel straight from the blocks. Memory-bound:
  the bytes read are the file's bytes.
- more rows (prefill): the weight is dequantized DEQUANT_CHUNK_BYTES at a time into a float32 buffer and multiplied
  by torch's GEMM (compute-bound; unpacking costs 1/R of the product per row).
Gradients (training through the swarm) flow to the input through the dequantized weight; the weight is frozen.
"""
from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from swarmlm.kernels import library
from swarmlm.small_reads import id_bounds

# activation rows up to which the kernel reads the blocks directly: measured against dequantize + GEMM on Q4_1 at
# 1536 x 576 and 8192 x 2048 (one thread), the kernel was faster up to 64 rows and slower at 128 (docs/RESULTS-packed.md)
DIRECT_ROWS = 64
DEQUANT_CHUNK_BYTES = 16 << 20  # float32 bytes of weight unpacked at a time above DIRECT_ROWS
# products of at least this many weights are split between torch's number of threads (the kernels' own workers):
# smaller ones finish before a sleeping worker wakes (SmolLM2's 576 x 1536 takes ~40 us on one thread)
THREADED_MIN_WEIGHTS = 1 << 20
# weights are held in 2 MiB pages where the OS allows (Linux transparent huge pages, asked for per mapping): a product
# reads its weight rows as one stream, and with 4 KiB pages every page costs a TLB walk and stops the hardware
# prefetcher; Llama-3.2-1B's Q4_0 blocks read ~1.15x faster from 2 MiB pages (docs/RESULTS-packed.md, round 4)
HUGE_PAGE_BYTES = 2 << 20
# ... and a weight smaller than a huge page shares them with others (WeightArena): SmolLM2-135M's are all 0.2-0.6 MiB,
# and on small pages a server's decode step took ~1.07x as long (docs/RESULTS-packed.md, round 14)
ARENA_CHUNK_BYTES = 32 << 20

# GGMLQuantizationType numbers this module keeps packed (the kernels in packed.c): name -> (number, weights per
# block, bytes per block)
PACKED_TYPES = {
    "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210), "F16": (1, 32, 64), "BF16": (30, 32, 64),
    # swarmlm's own, not in GGUF files: float32 d and m, 32 uint8 (asymmetric 8-bit; --quant int8, model/quant.py)
    "Q8_M": (1001, 32, 40),
}


class PackedError(ValueError):
    """Quantized data that cannot be what it claims (wrong size, unknown type): one line naming the tensor."""


@dataclass(frozen=True)
class PackedTensor:
    """A [rows, cols] matrix in one GGUF block type: `data` uint8 [rows, row_bytes], each row as held in memory
    (the file's blocks; Q4_0 / Q4_1 / Q8_0 / Q4_K split into quants then scales: kernels/packed.c)."""

    type_name: str
    data: torch.Tensor
    cols: int

    def __post_init__(self) -> None:
        if self.type_name not in PACKED_TYPES:
            raise PackedError(f"{self.type_name} is not a packed type ({', '.join(PACKED_TYPES)})")
        _, block, _ = PACKED_TYPES[self.type_name]
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or not self.data.is_contiguous():
            raise PackedError(f"packed {self.type_name} data must be contiguous uint8 [rows, row_bytes]")
        if self.cols <= 0 or self.cols % block:
            raise PackedError(f"{self.type_name} rows hold whole blocks of {block} weights, not {self.cols}")
        want = held_row_bytes(self.type_name, self.cols)
        if self.data.shape[1] != want:
            raise PackedError(f"{self.type_name} rows of {self.cols} weights take {want} bytes in memory, "
                              f"got {self.data.shape[1]}")

    @property
    def ggml_type(self) -> int:
        return PACKED_TYPES[self.type_name][0]

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    def select_rows(self, index: torch.Tensor) -> "PackedTensor":
        return PackedTensor(self.type_name, self.data[index].contiguous(), self.cols)

    def dequantize(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """float32 [end - start, cols]: rows [start, end) as gguf-py's dequantize gives them."""
        end = self.rows if end is None else end
        out = torch.empty(end - start, self.cols, dtype=torch.float32)
        if end > start:
            _check(library().packed_dequantize(self.ggml_type, self.data.data_ptr(), self.data.shape[1], self.cols,
                                               out.data_ptr(), start, end))
        return out

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [R, cols] float32 contiguous -> x @ W.T [R, rows]."""
        rows = x.shape[0]
        if rows == 0:  # (the kernels take at least one row)
            return torch.empty(0, self.rows, dtype=torch.float32)
        if rows > DIRECT_ROWS:
            return self._matmul_dequantized(x)
        y = torch.empty(rows, self.rows, dtype=torch.float32)
        lib = threaded_library()
        _check(lib.packed_matmul_threads(self.ggml_type, self.data.data_ptr(), self.data.shape[1], x.data_ptr(), rows,
                                         self.cols, y.data_ptr(), self.rows, THREADED_MIN_WEIGHTS))
        return y

    def _matmul_dequantized(self, x: torch.Tensor) -> torch.Tensor:
        step = max(1, DEQUANT_CHUNK_BYTES // (4 * self.cols))
        if step >= self.rows:
            return x @ self.dequantize().T
        y = torch.empty(x.shape[0], self.rows, dtype=torch.float32)
        for start in range(0, self.rows, step):
            end = min(start + step, self.rows)
            torch.matmul(x, self.dequantize(start, end).T, out=y[:, start:end])
        return y


def threaded_library():
    """The kernels, their pool told torch's thread count first: every caller of a threaded product (PackedTensor
    and the one-call decoder) goes through here, so `torch.set_num_threads` is the one setting. What a build's pool
    was last told is kept on that build (tests load other builds beside the native one)."""
    lib = library()
    n = torch.get_num_threads()
    if n != lib.pool_threads:
        lib.packed_set_threads(n)
        lib.pool_threads = n
    return lib


def _check(code: int) -> None:
    if code != 0:
        raise PackedError("the packed kernel refused the call (unknown type or a row not whole blocks)")


def file_row_bytes(type_name: str, cols: int) -> int:
    """Bytes of one row of `cols` weights in the file."""
    _, block, size = PACKED_TYPES[type_name]
    return cols // block * size


def held_row_bytes(type_name: str, cols: int) -> int:
    """Bytes of one row of `cols` weights as held in memory: the file's, but 1.03x / 1.02x for split Q4_K / Q5_K
    (their 6-bit scales and mins kept as bytes)."""
    return int(library().packed_row_bytes(PACKED_TYPES[type_name][0], cols))


def held_buffer(rows: int, row_bytes: int) -> torch.Tensor:
    """uint8 [rows, row_bytes] for packed weights, on huge pages where the OS has such advice (else torch's allocator):
    a weight of a huge page or more in a mapping of its own (its 2 MiB-aligned part; the tail takes small pages, so
    memory is the bytes asked for), a smaller one beside others in the process's `WeightArena`."""
    size = rows * row_bytes
    if size == 0 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(rows, row_bytes, dtype=torch.uint8)
    if size >= HUGE_PAGE_BYTES:
        return huge_page_region(size).view(rows, row_bytes)
    return SMALL_WEIGHTS.take(size).view(rows, row_bytes)


def huge_page_region(size: int) -> torch.Tensor:
    """uint8 [size] from 2 MiB-aligned memory of a private mapping asked to be backed by huge pages (the untouched
    pages before it and after it cost no memory)."""
    region = mmap.mmap(-1, size + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive; unmapped with its last view
    start = -whole.data_ptr() % HUGE_PAGE_BYTES
    return whole[start:start + size]


class WeightArena:
    """Packed weights smaller than a huge page, side by side in regions of `chunk_bytes` on huge pages (each weight at
    a multiple of ALIGN bytes; a weight that does not fit the region's rest begins the next one). A region is unmapped
    when its last weight is gone and the arena has moved on: it keeps at most its current region beyond its weights.
    Memory is the bytes handed out, plus at most part of a huge page per region (where the last weight ends)."""

    ALIGN = 64  # (what torch's allocator gives: the kernels' vector loads)

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self._region: torch.Tensor | None = None
        self._at = 0
        self._lock = threading.Lock()  # (weights may be packed from more than one thread)

    def take(self, size: int) -> torch.Tensor:
        """uint8 [size], size < chunk_bytes, written by nothing else."""
        with self._lock:
            if self._region is None or self._at + size > self.chunk_bytes:
                self._region, self._at = huge_page_region(self.chunk_bytes), 0
            held = self._region[self._at:self._at + size]
            self._at += -(-size // self.ALIGN) * self.ALIGN
            return held


SMALL_WEIGHTS = WeightArena(ARENA_CHUNK_BYTES)


def packed_from_numpy(type_name: str, raw: np.ndarray, cols: int, name: str = "tensor") -> PackedTensor:
    """A GGUF tensor's raw bytes (uint8 [rows, row_bytes] as in the file: gguf_reader's view), copied into process
    memory in the layout the kernels read."""
    try:
        if type_name not in PACKED_TYPES:
            raise PackedError(f"{type_name} is not a packed type ({', '.join(PACKED_TYPES)})")
        if cols <= 0 or cols % PACKED_TYPES[type_name][1]:
            raise PackedError(f"{type_name} rows hold whole blocks of {PACKED_TYPES[type_name][1]} weights, not {cols}")
        rows = raw.reshape(raw.shape[0], -1) if raw.ndim >= 1 and raw.size else raw.reshape(0, 0)
        if rows.dtype != np.uint8 or rows.shape[1] != file_row_bytes(type_name, cols):
            raise PackedError(f"{type_name} rows of {cols} weights take {file_row_bytes(type_name, cols)} bytes in "
                              f"the file, got {rows.shape[1] if rows.ndim == 2 else '?'}")
        src = np.ascontiguousarray(rows)
        data = held_buffer(src.shape[0], held_row_bytes(type_name, cols))
        _check(library().packed_repack(PACKED_TYPES[type_name][0], src.ctypes.data, src.shape[1], src.shape[0], cols,
                                       data.data_ptr()))
        return PackedTensor(type_name, data, cols)
    except PackedError as exc:
        raise PackedError(f"{name}: {exc}") from None


class PackedLinear(nn.Module):
    """nn.Linear whose weight stays in its GGUF blocks (`weight` is not a parameter: it is frozen and packed)."""

    def __init__(self, weight: PackedTensor, bias: torch.Tensor | None = None, softcap: float | None = None) -> None:
        super().__init__()
        self.packed = weight
        self.in_features, self.out_features = weight.cols, weight.rows
        self.register_buffer("packed_data", weight.data, persistent=False)  # counted among the module's buffers
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.softcap = softcap  # Gemma 2's final logit softcapping, when this is its LM head (families/gemma2.py)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight [out, in] (allocated per access: for code that must see a matrix, not the hot path)."""
        return self.packed.dequantize()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"type={self.packed.type_name}, bias={self.bias is not None}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad and torch.is_grad_enabled():
            return _PackedLinearGrad.apply(x, self)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            flat = flat.float().contiguous()
        y = self.packed.matmul(flat)
        if self.bias is not None:
            y += self.bias
        if self.softcap is not None:
            y = torch.tanh(y / self.softcap) * self.softcap
        return y.to(x.dtype).reshape(*lead, self.out_features)


class _PackedLinearGrad(torch.autograd.Function):
    """The packed product forward; dx = dy W through the dequantized weight (unpacked per call: training only)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, module: PackedLinear) -> torch.Tensor:
        ctx.module = module
        return module._forward(x.detach())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad @ ctx.module.packed.dequantize().to(grad.dtype), None


def packed_types(module: nn.Module) -> str:
    """The block types of the packed layers below `module`, sorted and comma-separated ("" = none)."""
    found = {m.packed.type_name for m in module.modules() if isinstance(m, (PackedLinear, PackedEmbedding))}
    return ",".join(sorted(found))


class PackedEmbedding(nn.Module):
    """nn.Embedding over packed rows: a lookup dequantizes only the rows asked for."""

    def __init__(self, weight: PackedTensor, scale: torch.Tensor | float | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.packed = weight
        self.num_embeddings, self.embedding_dim = weight.rows, weight.cols
        self.register_buffer("packed_data", weight.data, persistent=False)
        self.scale = None if scale is None else float(scale)  # Gemma 2 scales embeddings by sqrt(hidden)
        self.dtype = dtype  # of the rows a lookup returns (the client's compute dtype)

    @property
    def weight(self) -> torch.Tensor:
        return self.packed.dequantize()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if flat.numel():
            low, high = id_bounds(flat)
            if low < 0 or high >= self.num_embeddings:
                raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        # a decode step's one token: its row straight from the blocks, no unique / gather (each torch call costs tens
        # of us cold); float ids go the general way, whose indexing refuses them
        if flat.numel() == 1 and not flat.is_floating_point():
            rows, inverse = self.packed.dequantize(low, low + 1), None
        else:
            unique, inverse = torch.unique(flat, return_inverse=True)
            rows = self.packed.select_rows(unique).dequantize()
        if self.scale is not None:
            rows = rows * torch.tensor(self.scale, dtype=rows.dtype)
        rows = rows.to(self.dtype)
        return (rows if inverse is None else rows[inverse]).reshape(*ids.shape, self.embedding_dim)


