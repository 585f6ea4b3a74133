"""Hugging Face checkpoints (`config.json` + `*.safetensors`, sharded or not), from a directory or a hub id.

A server reads only the tensors of its block range, a client only embeddings, norms and head: nothing else of
the model is ever materialised, and with a hub id only the shards holding those tensors are downloaded.
Every loader takes a directory, a hub id (`org/name[@revision]`) or a resolved `ModelSource`.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from swarmlm.config import dtype_name
from swarmlm.model.families import ClientModules, FamilyAdapter, family_for
from swarmlm.model.gguf import GGUFCheckpoint, open_gguf
from swarmlm.model.packed import PackedLinear, PackedTensor
from swarmlm.model.quant import check_quant, keeps_file_blocks, linear_names, packed_embedding, quantize_linears, \
    swap_in_packed
from swarmlm.model.source import ModelSource, resolve

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ModelRef = str | Path | ModelSource  # a directory, a hub id, or either resolved


def parse_dtype(name: str | torch.dtype, model: ModelRef | None = None) -> torch.dtype:
    """A dtype as transformers takes it (config.dtype_name: "float32", torch.float32...); "auto" needs the model:
    its checkpoint's own dtype (see auto_dtype)."""
    name = dtype_name(name)
    if name == "auto":
        if model is None:
            raise ValueError('dtype "auto" means the checkpoint\'s own dtype: give the model too')
        return auto_dtype(load_config(model))
    return DTYPES[name]


def checkpoint_dtype(config: PretrainedConfig) -> torch.dtype:
    """What the checkpoint stores (config's `dtype`, formerly `torch_dtype`); float32 when it does not say."""
    # (vars(): an older config's own attribute; transformers 5's `torch_dtype` property prints a deprecation warning)
    value = getattr(config, "dtype", None) or vars(config).get("torch_dtype") or torch.float32
    if isinstance(value, str):
        value = getattr(torch, value, torch.float32)
    return value if value in DTYPES.values() else torch.float32


_warned: set[str] = set()  # checkpoints already reported (one line per process, not per load)


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (AMX tiles, as torch reports them).

    With AMX, bf16 beats fp32 here (torch 2.13, one thread, BLOOMZ-560M, benchmarks/dtype_bench.py: 6 blocks'
    100-token prefill 52 vs 130 ms, 8-row decode 30 vs 60 ms, 1-row 22 vs 23 ms, the 250,880 x 1,024 LM head at 8
    rows 37 vs 121 ms; docs/RESULTS-perf.md "bf16 on CPUs with AMX"). Without AMX there are no bf16 matrix units and
    fp32 stays the default (this project's earlier note had bf16 prefill 4-7x slower than fp32; setup not recorded).
    torch's check is private: if it is missing or fails, assume no AMX."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    try:
        return bool(amx is not None and torch.backends.mkldnn.is_available() and amx())
    except Exception:  # a private API: if its contract changes, fall back to the safe answer
        return False


def auto_dtype(config: PretrainedConfig) -> torch.dtype:
    """The checkpoint's dtype, except on a CPU-only machine: bfloat16 stays bfloat16 only where the CPU has bf16
    matrix units (cpu_has_bf16_matmul); float16 always runs as float32: AMX's bf16 units do not take it, and its
    gain is small and not everywhere (BLOOMZ-560M here: one-row decode 0.88x fp32's speed, 8 rows 1.4x, where bf16
    gives 2x; docs/RESULTS-perf.md). Asking for the half dtype explicitly keeps it."""
    stored = checkpoint_dtype(config)
    if stored not in (torch.bfloat16, torch.float16) or torch.cuda.is_available():
        return stored
    if stored == torch.bfloat16 and cpu_has_bf16_matmul():
        return stored
    name = str(stored).removeprefix("torch.")
    if config.name_or_path not in _warned:
        _warned.add(config.name_or_path)
        why = ("torch reports no AMX bf16 units on this CPU; without them bf16 is usually slower than float32"
               if stored == torch.bfloat16 else "float16 is not reliably faster than float32 on a CPU")
        log.warning("the checkpoint is %s; running it as float32 on this CPU (%s); pass --dtype %s to keep it",
                    name, why, name)
    return torch.float32


def load_config(model: ModelRef) -> PretrainedConfig:
    source = resolve(model)
    if source.gguf is not None:
        return open_gguf(source.gguf).config  # configured for its family when parsed
    config_file = source.optional_file("config.json")
    if config_file is None:
        raise FileNotFoundError(f"{source.name} has no config.json: not a checkpoint directory")
    config = AutoConfig.from_pretrained(config_file.parent)
    # the kernels the block modules run are the ones transformers' AutoModel picks for the family
    family_for(config).configure(config)
    return config


def load_tokenizer(model: ModelRef):
    """The checkpoint's tokenizer (with its chat template): AutoTokenizer's, from the directory, hub id or GGUF."""
    from transformers import AutoTokenizer

    source = resolve(model)
    if source.gguf is not None:
        return open_gguf(source.gguf).tokenizer()
    if source.directory is not None:
        return AutoTokenizer.from_pretrained(source.directory)
    return AutoTokenizer.from_pretrained(source.repo_id, revision=source.revision)


def load_transformers_model(model: ModelRef, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The whole model in plain transformers, the reference a swarm's output is checked against."""
    from transformers import AutoModelForCausalLM

    source = resolve(model)
    if source.gguf is not None:
        where, extra = source.gguf.parent, {"gguf_file": source.gguf.name}
    else:
        where, extra = source.directory or source.repo_id, {"revision": source.revision} if source.is_hub else {}
    return AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **extra).eval()


def num_blocks(config: PretrainedConfig) -> int:
    return int(config.num_hidden_layers)


class TensorIndex:
    """Which safetensors file holds which tensor; reads single tensors without loading whole files.

    For a hub id, `files` points into the local cache snapshot, and a shard is downloaded only when `read`
    first needs one of its tensors."""

    def __init__(self, model: ModelRef) -> None:
        self.source = resolve(model)
        index = self.source.optional_file("model.safetensors.index.json")
        if index is not None:
            self.model_dir = index.parent
            self.shard_of: dict[str, str] = json.loads(index.read_text())["weight_map"]
        else:
            single = self.source.optional_file("model.safetensors")
            if single is None:
                raise FileNotFoundError(f"{self.source.name} has neither model.safetensors nor its index")
            self.model_dir = single.parent
            with safe_open(single, framework="pt") as f:
                self.shard_of = {k: "model.safetensors" for k in f.keys()}
        self.files = {k: self.model_dir / v for k, v in self.shard_of.items()}

    def path(self, key: str) -> Path:
        """The shard holding `key`, downloaded first if it is not local."""
        return self.source.file(self.shard_of[key])

    def shape(self, key: str) -> list[int]:
        with safe_open(self.path(key), framework="pt") as f:  # (a hub id: fetched if not cached)
            return list(f.get_slice(key).get_shape())

    def is_local(self, key: str) -> bool:
        return self.source.is_local(self.shard_of[key])

    def find(self, candidates: list[str]) -> str | None:
        return next((c for c in candidates if c in self.files), None)

    def keys_under(self, prefix: str) -> list[str]:
        return sorted(k for k in self.shard_of if k.startswith(prefix))

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        by_file: dict[str, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.shard_of[key], []).append(key)
        out: dict[str, torch.Tensor] = {}
        for filename, names in by_file.items():
            with safe_open(self.source.file(filename), framework="pt") as f:
                for name in names:
                    out[name] = f.get_tensor(name)
        return out

    def stack_prefix(self, adapter: FamilyAdapter) -> str:
        for prefix in adapter.stack_prefixes:
            probe = prefix + adapter.block_prefix().format(0)
            if any(k.startswith(probe) for k in self.shard_of):
                return prefix
        raise ValueError(f"{self.source.name}: no tensors of block 0 under {adapter.stack_prefixes}")


class GGUFTensorIndex(TensorIndex):
    """The same questions answered from a GGUF file: its tensors under their transformers names, each read (and
    dequantized) on its own (model/gguf.py)."""

    def __init__(self, model: ModelRef) -> None:
        self.source = resolve(model)
        self.gguf: GGUFCheckpoint = open_gguf(self.source.gguf)
        self.shard_of = {k: self.source.gguf.name for k in self.gguf.keys()}
        self.files = {k: self.source.gguf for k in self.shard_of}

    def path(self, key: str) -> Path:
        return self.source.gguf

    def shape(self, key: str) -> list[int]:
        dims = self.gguf.tensors[self.gguf.hf_to_gguf[key]].shape  # GGUF's order: the fastest axis first
        return [int(n) for n in reversed(dims)]

    def is_local(self, key: str) -> bool:
        return True

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        return self.gguf.read(keys)


def tensor_index(model: ModelRef) -> TensorIndex:
    """Where the checkpoint's tensors are: safetensors files, or a GGUF."""
    return GGUFTensorIndex(model) if resolve(model).gguf is not None else TensorIndex(model)


def _dtype(dtype: torch.dtype | str, config: PretrainedConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    return auto_dtype(config) if dtype == "auto" else parse_dtype(dtype)


def load_blocks(
    model: ModelRef, start: int, end: int, dtype: torch.dtype | str = torch.float32, quant: str = "auto",
    mmap: bool = False,
) -> tuple[PretrainedConfig, FamilyAdapter, nn.ModuleList]:
    """Blocks [start, end) of the checkpoint; their caches use layers 0..end-start-1.

    A GGUF's quantized matrices stay in the file's blocks (quant "auto"; model/quant.py): each linear layer whose
    weight is one becomes a PackedLinear holding the file's bytes, the rest (norms, biases, other types) is
    dequantized. Float weights are copied into the process's own memory, block by block. `mmap=True` keeps
    full-precision weights as views of the safetensors file's mapping instead: its pages are shared by every process
    on the host that serves the same file, but on this machine a decode step reads them ~1.5x slower (a memory-bound
    matmul over file-backed pages; docs/RESULTS-perf.md, "weights in process memory").

    With quant "int8" / "int4" each block is quantized as soon as it is read, so at most one block is ever held in
    full precision: the process's peak (and, since the allocator keeps freed heap, its resident) memory follows the
    quantized size, not the checkpoint's."""
    config = load_config(model)
    if not 0 <= start < end <= num_blocks(config):
        raise ValueError(f"blocks [{start}, {end}) outside the model's [0, {num_blocks(config)})")
    dtype = _dtype(dtype, config)
    adapter = family_for(config)
    index = tensor_index(model)
    keep_blocks = keeps_file_blocks(quant, isinstance(index, GGUFTensorIndex))
    prefix = index.stack_prefix(adapter)
    blocks = nn.ModuleList()
    for local, global_idx in enumerate(range(start, end)):
        block_prefix = prefix + adapter.block_prefix().format(global_idx)
        with torch.device("meta"):  # no random init of weights we are about to replace
            block = adapter.build_block(config, global_idx, cache_idx=local)
        keys = index.keys_under(block_prefix)
        packed = _packed_linears(index, block, block_prefix, keys) if keep_blocks else {}
        tensors = index.read([k for k in keys if k[len(block_prefix):].removesuffix(".weight") not in packed])
        # safetensors' tensors are views of the file's mmap; to quantize, copy them too, or the norms and biases
        # left over would keep the whole mapping, and every weight page quantization read, resident
        copy = not mmap or quant in ("int8", "int4")
        state = adapter.convert_block_state({k[len(block_prefix):]: v.to(dtype, copy=copy) for k, v in tensors.items()})
        swap_in_packed(block, packed)
        block.load_state_dict(state, strict=True, assign=True)
        del tensors, state  # the block's own full-precision copy is the only one left ...
        blocks.append(quantize_linears(block.eval().requires_grad_(False), quant))  # ... until this replaces it
        if isinstance(index, GGUFTensorIndex):
            index.gguf.release_pages()  # the file's pages read for this block: copied, not to be kept resident
        log.info("block %d loaded (%d of %d)", global_idx, local + 1, end - start)  # a server's start-up progress
    return config, adapter, blocks


def _packed_linears(index: "GGUFTensorIndex", block: nn.Module, block_prefix: str,
                    keys: list[str]) -> dict[str, PackedTensor]:
    """The block's linear layers whose GGUF weight stays in its blocks: layer name -> its PackedTensor."""
    linears = linear_names(block)
    packed = {}
    for key in keys:
        name = key[len(block_prefix):].removesuffix(".weight")
        if key.endswith(".weight") and name in linears and index.gguf.packable(key):
            weight = index.gguf.read_packed(key)
            if weight is not None:
                packed[name] = weight
    return packed


def load_client_modules(
    model: ModelRef, dtype: torch.dtype | str = torch.float32, quant: str = "auto",
) -> tuple[PretrainedConfig, FamilyAdapter, ClientModules]:
    """Embeddings, norms and LM head; a GGUF's quantized embeddings and head stay in their blocks (quant "auto")."""
    config = load_config(model)
    dtype = _dtype(dtype, config)
    adapter = family_for(config)
    index = tensor_index(model)
    prefix = index.stack_prefix(adapter)
    wanted: dict[str, str] = {}
    for name, candidates in adapter.client_tensor_names(config).items():
        full = [c[1:] if c.startswith("/") else prefix + c for c in candidates]
        found = index.find(full)
        if found is None:
            raise ValueError(f"{index.source.name}: none of {full} found for {name}")
        wanted[name] = found
    packed = _packed_client(index, wanted) if keeps_file_blocks(quant, isinstance(index, GGUFTensorIndex)) else {}
    # copied out of the file's mapping, once per tensor (tied embeddings stay one tensor): the LM head is read
    # whole every token, ~1.8x faster from process memory here (docs/RESULTS-perf.md, "weights in process memory")
    floats = sorted({k for n, k in wanted.items() if n not in packed})
    tensors = {k: t.to(dtype, copy=True) for k, t in index.read(floats).items()}
    for name, weight in packed.items():  # placeholders: the packed modules replace these below
        tensors[wanted[name]] = torch.empty(weight.shape, device="meta")
    mods = adapter.build_client(config, {n: tensors[k] for n, k in wanted.items()})
    if isinstance(index, GGUFTensorIndex):
        index.gguf.release_pages()
    if "embed.weight" in packed:
        mods.embed = packed_embedding(mods.embed, packed["embed.weight"], dtype)
    if "lm_head.weight" in packed:
        mods.lm_head = PackedLinear(packed["lm_head.weight"], getattr(mods.lm_head, "bias", None),
                                    softcap=getattr(mods.lm_head, "softcap", None))
    return config, adapter, mods


def _packed_client(index: "GGUFTensorIndex", wanted: dict[str, str]) -> dict[str, PackedTensor]:
    """The embeddings and LM head kept in their GGUF blocks (a tied head shares the embeddings' one copy)."""
    by_key: dict[str, PackedTensor | None] = {}
    for name in ("embed.weight", "lm_head.weight"):
        key = wanted.get(name)
        if key is not None and key not in by_key:
            by_key[key] = index.gguf.read_packed(key) if index.gguf.packable(key) else None
    return {n: by_key[k] for n, k in wanted.items() if by_key.get(k) is not None}
