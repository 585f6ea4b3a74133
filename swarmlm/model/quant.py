"""Which form a server's (and a client's) weights take in memory, and the swap of linear layers into that form.

One setting, `quant` (QUANT_NAMES):
- "auto" (the default): a GGUF's matrices stay in the file's own blocks (model/packed.py: Q4_0, Q4_1, Q5_0, Q5_1,
  Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16; any other type is dequantized with a one-line notice); a float checkpoint
  stays float.
- "none": everything dequantized to the compute dtype (transformers' own values; for exactness tests).
- "int8" / "int4": a float checkpoint's linear layers quantized on load, weight-only, in blocks of 32 weights with
  their own scale and minimum (Q8_M: 8 bits, asymmetric, swarmlm's own; Q4_1: GGUF's), run by the same kernels as a
  GGUF. Block-wise ranges keep a trained model's outlier weights apart; an asymmetric range spends every step on
  the block's values (Q8_0's symmetric +-absmax wastes half of them on a skewed block: 0.6 % weight error against
  Q8_M's 0.0 % on SmolLM2's float copy); activations stay float32 (docs/RESULTS-perf.md "Packed weights").

What a server announces (`announced_quant`) says whether its function differs from the checkpoint's: a GGUF served
packed computes the file's own values (to float32 summation order; Q4_0 / Q4_1 / Q8_0 / Q4_K products round activations to int16
blocks, ~3e-5 relative, kernels/act16.c), so it announces "none", exactly as a server that dequantized the file;
int8 / int4 change the weights' values and say so.
"""
from __future__ import annotations

import logging
import math

import numpy as np
import torch
from torch import nn

from swarmlm.config import QUANT_NAMES
from swarmlm.model.packed import PACKED_TYPES, PackedEmbedding, PackedLinear, PackedTensor, packed_from_numpy

log = logging.getLogger(__name__)

QUANT_TYPES = {"int8": "Q8_M", "int4": "Q4_1"}  # a float checkpoint's linears under --quant int8 / int4
# the client's embeddings and LM head: 8-bit under int4 too, as llama.cpp keeps its output tensor at 6 bits or more
# in its 4-bit files: 4-bit head + embeddings alone took SmolLM2's greedy agreement from 100 % to 89 %
CLIENT_QUANT_TYPES = {"int8": "Q8_M", "int4": "Q8_M"}
BLOCK = 32  # weights per quantization block (Q8_0 / Q4_1): a layer whose inputs are not whole blocks stays float


def check_quant(quant: str) -> str:
    if quant not in QUANT_NAMES:
        raise ValueError(f"quant must be one of {', '.join(QUANT_NAMES)}, got {quant!r}")
    return quant


def keeps_file_blocks(quant: str, is_gguf: bool) -> bool:
    """Are a GGUF's quantized matrices kept in their blocks (rather than dequantized)?"""
    if is_gguf and check_quant(quant) in QUANT_TYPES:
        raise ValueError(f"quant {quant!r} quantizes a float checkpoint; a GGUF is served in its own blocks "
                         "(quant auto) or dequantized (quant none)")
    return is_gguf and quant == "auto"


def announced_quant(quant: str, is_gguf: bool) -> str:
    """"none" when the weights compute the checkpoint's own values (float, or a GGUF's blocks), else int8 / int4."""
    keeps_file_blocks(quant, is_gguf)  # refuses int8 / int4 on a GGUF
    return quant if quant in QUANT_TYPES else "none"


def quantize_matrix(weight: torch.Tensor, type_name: str) -> PackedTensor:
    """A float [rows, cols] matrix in a GGUF block type (gguf-py's quantizer: llama.cpp's rounding)."""
    import gguf

    values = weight.detach().to(torch.float32).contiguous().numpy()
    if type_name == "Q8_M":
        raw = quantize_q8_m(values)
    else:
        raw = gguf.quantize(values, gguf.GGMLQuantizationType[type_name])
    return packed_from_numpy(type_name, raw, int(weight.shape[1]))


def quantize_q8_m(values: np.ndarray) -> np.ndarray:
    """[rows, cols] float32 -> Q8_M blocks [rows, cols / 32 * 40]: per 32 weights d = (max - min) / 255, m = min,
    q = round((w - m) / d), so the block's extremes are exact and every step is d."""
    rows, cols = values.shape
    blocks = values.reshape(rows, cols // BLOCK, BLOCK)
    low, high = blocks.min(axis=-1, keepdims=True), blocks.max(axis=-1, keepdims=True)
    scale = ((high - low) / 255).astype(np.float32)
    inverse = np.divide(1, scale, out=np.zeros_like(scale), where=scale > 0)
    q = np.clip(np.rint((blocks - low) * inverse), 0, 255).astype(np.uint8)
    raw = np.concatenate([scale.view(np.uint8), low.astype(np.float32).view(np.uint8), q], axis=-1)
    return raw.reshape(rows, -1)


def linear_names(module: nn.Module) -> dict[str, nn.Linear]:
    """The nn.Linear layers below `module` by name (subclasses included)."""
    return {name: m for name, m in module.named_modules() if isinstance(m, nn.Linear)}


def swap_in_packed(module: nn.Module, packed: dict[str, PackedTensor]) -> nn.Module:
    """Replace the linear layers named in `packed` ("mlp.down_proj" -> its PackedTensor) by PackedLinear; each
    keeps its bias. A replaced layer's float weight is dropped."""
    for name, weight in packed.items():
        old = module.get_submodule(name)
        if tuple(weight.shape) != (old.out_features, old.in_features):
            raise ValueError(f"{name}: packed weight {tuple(weight.shape)} does not fit the layer "
                             f"[{old.out_features}, {old.in_features}]")
        module.set_submodule(name, PackedLinear(weight, old.bias, softcap=getattr(old, "softcap", None)))
    return module


def quantize_linears(module: nn.Module, quant: str) -> nn.Module:
    """Every float nn.Linear below `module` to QUANT_TYPES[quant] blocks, in place ("none"/"auto": unchanged)."""
    if check_quant(quant) not in QUANT_TYPES:
        return module
    packed = {name: quantize_matrix(m.weight, QUANT_TYPES[quant]) for name, m in linear_names(module).items()
              if type(m) is not PackedLinear and m.in_features % BLOCK == 0}
    return swap_in_packed(module, packed)


def quantize_client_modules(modules, quant: str):
    """The client's LM head and embeddings in CLIENT_QUANT_TYPES[quant] blocks (in place on the ClientModules)."""
    if check_quant(quant) not in CLIENT_QUANT_TYPES:
        return modules
    type_name = CLIENT_QUANT_TYPES[quant]
    embed_weight = getattr(modules.embed, "weight", None)
    if isinstance(modules.embed, nn.Embedding) and modules.embed.embedding_dim % BLOCK == 0:
        modules.embed = packed_embedding(modules.embed, quantize_matrix(embed_weight, type_name), embed_weight.dtype)
    head = modules.lm_head
    if isinstance(head, nn.Linear) and type(head) is not PackedLinear and head.in_features % BLOCK == 0:
        tied = isinstance(modules.embed, PackedEmbedding) and head.weight is embed_weight
        weight = modules.embed.packed if tied else quantize_matrix(head.weight, type_name)  # tied: one copy
        modules.lm_head = PackedLinear(weight, head.bias, softcap=getattr(head, "softcap", None))
    return modules


def packed_embedding(embed: nn.Module, weight: PackedTensor, dtype: torch.dtype = torch.float32) -> PackedEmbedding:
    """PackedEmbedding in place of nn.Embedding, keeping a scaled embedding's factor (Gemma 2's embed_scale)."""
    return PackedEmbedding(weight, scale=getattr(embed, "embed_scale", None), dtype=dtype)


def loaded_bytes(shape: list[int] | tuple[int, ...], itemsize: int, quant: str, packed_bytes: int | None = None) -> int:
    """Bytes a checkpoint tensor takes once loaded: `packed_bytes` (a GGUF block tensor kept packed), a matrix in
    int8 / int4 blocks, or the compute dtype's size."""
    if packed_bytes is not None:
        return packed_bytes
    values = math.prod(shape)
    if quant in QUANT_TYPES and len(shape) == 2 and shape[1] % BLOCK == 0:
        _, block, size = PACKED_TYPES[QUANT_TYPES[quant]]
        return values // block * size
    return values * itemsize


def weight_bytes(module: nn.Module) -> int:
    """Bytes of a module's weights in memory: parameters and buffers (packed blocks are buffers), each tensor's own
    bytes (not its storage's: packed weights share regions, model/packed.py WeightArena), a tied one once."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        key = (t.data_ptr(), t.nbytes)
        if key not in seen:
            seen.add(key)
            total += t.nbytes
    return total
