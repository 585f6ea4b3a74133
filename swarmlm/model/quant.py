"""int8 weights: a server's linear layers, the client's LM head and embeddings, quantized on load.

Linear layers run PyTorch's dynamic int8 kernel (`quantized::linear_dynamic`, x86/fbgemm engine): weights int8
with one scale per output row (symmetric), activations quantized per call to uint8, int8 x uint8 GEMM with int32
accumulation. Measured on this CPU it was the fastest maintained kernel at both decode (1 row) and prefill (128
rows) shapes: 0.36-0.72x fp32's time where the weight-only int8 kernels (aten._weight_int8pack_mm, torchao's
Int8WeightOnly) were 1.3-35x SLOWER than fp32 (benchmarks/quant_bench.py, docs/RESULTS-perf.md).

Two choices keep its accuracy (BLOOMZ-560M logits 4.8 % -> 2.8 % relative L2 of fp32, docs/RESULTS-perf.md):
- Full 8-bit activations where the CPU accumulates in int32 (AVX512-VNNI): torch's module asks the kernel for
  7-bit ones (`reduce_range=True`), which only the older AVX2 path needs (its u8 x s8 pair sums saturate int16).
  So the error depends on the CPU (logits_error_bound): 2.8 % with VNNI, 4.1 % on AVX2-only CPUs (and AVX512
  ones without VNNI), measured with fbgemm's AVX2 kernels forced on a VNNI CPU. 8-bit activations with 7-bit
  weights instead (pairs fit int16 too) measured 4.4 %.
- Every row (token) gets its own activation range: the kernel takes one range per call, so in a prompt one
  outlier token would coarsen all the others, and in a batch one session would change another's result. Each row
  is mapped affinely onto [-1, 1] before the call and back after (`W x = s W x' + c W 1`, exact for a linear map),
  its extremes set to exactly -1 and 1, so every call of several rows has the same range whatever rows it holds;
  a single row (a decode step) goes straight to the kernel, whose range is then that row's already.

Embeddings keep one int8 row per token with its own scale (a lookup dequantizes a handful of rows).

int8 needs float32 compute (the quantized kernels take fp32 activations); bf16/fp16 servers refuse it.
"""
from __future__ import annotations

import math
import warnings
from typing import Literal

import torch
from torch import nn
from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

from swarmlm.config import QUANT_NAMES
from swarmlm.machine import fbgemm_isa

Quant = Literal["none", "int8"]


def check_quant(quant: str, dtype: torch.dtype = torch.float32) -> Quant:
    if quant not in QUANT_NAMES:
        raise ValueError(f"quant must be one of {', '.join(QUANT_NAMES)}, got {quant!r}")
    if quant != "none" and dtype != torch.float32:
        raise ValueError(f"quant {quant!r} needs dtype float32 (the int8 kernels take fp32 activations), got {dtype}")
    return quant  # type: ignore[return-value]


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], scale [N] in the weight's dtype), symmetric per row."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.to(weight.dtype)


class Int8Embedding(nn.Module):
    """Embedding rows stored int8 with one scale per row (a token's vector is dequantized on lookup)."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = int(qweight.shape[0]), int(qweight.shape[1])
        self.register_buffer("qweight", qweight)  # [V, H] int8
        self.register_buffer("scale", scale)  # [V]

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding) -> "Int8Embedding":
        return cls(*quantize_rows(embedding.weight))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = nn.functional.embedding(ids, self.qweight)  # [..., H] int8
        return rows.to(self.scale.dtype) * self.scale[ids].unsqueeze(-1)


def int32_accumulation() -> bool:
    """Does fbgemm accumulate int8 products in int32 in this process (AVX512-VNNI, and not told to use less,
    swarmlm/machine.py fbgemm_isa), so 8-bit activations cannot saturate? Its AVX2 and AVX512 kernels sum pairs of
    u8 x s8 products in a saturating int16 first, which 7-bit activations (pairs <= 2 x 127 x 127) keep in range."""
    return fbgemm_isa().startswith("avx512_vnni")


def logits_error_bound() -> float:
    """What int8 (blocks + head) promises: relative L2 of a model's logits against fp32, on this CPU's kernels.
    Measured on BLOOMZ-560M shapes (random weights, 16 prompts): 2.8 % with 8-bit activations (int32
    accumulation), 4.1 % with 7-bit ones (benchmarks/int8_cpu_bench.py, docs/RESULTS-perf.md)."""
    return 0.03 if int32_accumulation() else 0.045


def map_rows_to_unit_range(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., K] -> (x', center, half) with x = center + half * x' and every row of x' spanning exactly [-1, 1].

    Exactly: the kernel quantizes a call with the range of all its rows, so if one row's rounded extreme came out
    as 0.99999994 and another's as 1.0, the rows batched together would change each other's quantization step (and
    zero point: with 7-bit activations, 63.5 rounds either way). Each row's extremes are set to -1 and 1."""
    hi, hi_at = x.max(dim=-1, keepdim=True)
    lo, lo_at = x.min(dim=-1, keepdim=True)
    center, half = (hi + lo) / 2, ((hi - lo) / 2).clamp_(min=1e-30)  # a constant row maps to (nearly) zeros
    mapped = ((x - center) / half).clamp_(-1.0, 1.0)
    return mapped.scatter_(-1, hi_at, 1.0).scatter_(-1, lo_at, -1.0), center, half


class Int8Linear(DynamicLinear):
    """torch's dynamic int8 linear with one activation range per row, 8-bit where the CPU allows (see above)."""

    # 7-bit activations only where int16 sums could saturate. fbgemm fixes its instruction set at start-up, so
    # this is decided once per process.
    reduce_range = not int32_accumulation()

    @classmethod
    def from_float(cls, mod: nn.Module, use_precomputed_fake_quant: bool = False) -> "Int8Linear":
        q = super().from_float(mod, use_precomputed_fake_quant)
        # sum over inputs of the int8 weights as the kernel sees them: the term a row's offset c contributes
        q.register_buffer("weight_sum", q.weight().dequantize().sum(dim=1))  # [out]
        # the packed bias, kept at hand: the module's bias() unpacks the whole weight on every call
        q.register_buffer("float_bias", q.bias())
        return q

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad and torch.is_grad_enabled():  # training through the swarm (server/training.py)
            return _Int8LinearGrad.apply(x, self)
        return self.int8_forward(x)

    def int8_forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self._packed_params._packed_params
        if x.numel() == x.shape[-1]:  # one row: the kernel's range is already the row's own (and no extra ops)
            return torch.ops.quantized.linear_dynamic(x, packed, reduce_range=self.reduce_range)
        mapped, center, half = map_rows_to_unit_range(x)
        y = torch.ops.quantized.linear_dynamic(mapped, packed, reduce_range=self.reduce_range)
        bias = self.float_bias  # the kernel added it to the mapped rows: W x' + b
        if bias is None:
            return torch.addcmul(y * half, center, self.weight_sum)  # s W x' + c W 1
        return torch.addcmul(torch.addcmul(bias, y - bias, half), center, self.weight_sum)


class _Int8LinearGrad(torch.autograd.Function):
    """The int8 kernel's output; its input gradient through the dequantized int8 weight, dx = dy W (the
    activations' rounding passes the gradient straight through). The weight gets no gradient: it is frozen."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, module: "Int8Linear") -> torch.Tensor:
        ctx.module = module
        return module.int8_forward(x.detach())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight = ctx.module.weight().dequantize()  # [out, in], unpacked per call: training only
        return grad @ weight.to(grad.dtype), None


def _dynamic_int8(module: nn.Module) -> nn.Module:
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():  # torch.ao.quantization announces its move to torchao; the kernels stay
        warnings.simplefilter("ignore")
        return quantize_dynamic(module, {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True,
                                mapping={nn.Linear: Int8Linear})


def quantize_linears(module: nn.Module, quant: Quant) -> nn.Module:
    """Every nn.Linear below `module` to int8 (in place); `none` changes nothing."""
    if check_quant(quant) == "none":
        return module
    return _dynamic_int8(module)


def quantize_client_modules(modules, quant: Quant, dtype: torch.dtype = torch.float32):
    """The client's LM head and embeddings to int8 (in place on the ClientModules); `none` changes nothing."""
    if check_quant(quant, dtype) == "none":
        return modules
    modules.embed = Int8Embedding.from_embedding(modules.embed)
    holder = nn.Module()
    holder.lm_head = modules.lm_head  # quantize_dynamic swaps children, not a root module
    modules.lm_head = _dynamic_int8(holder).lm_head
    return modules


def tensor_bytes(shape: list[int] | tuple[int, ...], itemsize: int, quant: str) -> int:
    """Bytes a checkpoint tensor takes once loaded: with int8, a matrix (a linear weight) keeps one byte per value
    plus a per-row scale, zero point and weight sum; the rest (norms, biases) stays in the compute dtype."""
    values = math.prod(shape)
    if quant == "int8" and len(shape) == 2:
        return values + 20 * int(shape[0])
    return values * itemsize


def weight_bytes(module: nn.Module) -> int:
    """Bytes of a module's weights in memory: parameters and buffers (each storage once), and the packed weights
    of dynamically quantized linears (which torch keeps outside parameters and buffers)."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    for m in module.modules():
        if isinstance(m, DynamicLinear):
            w = m.weight()  # int8 values + per-row scales and zero points
            total += w.numel() + w.q_per_channel_scales().nbytes + w.q_per_channel_zero_points().nbytes
            b = m.bias()
            if b is not None and b.untyped_storage().data_ptr() not in seen:  # Int8Linear also keeps it as a buffer
                seen.add(b.untyped_storage().data_ptr())
                total += b.nbytes
    return total
