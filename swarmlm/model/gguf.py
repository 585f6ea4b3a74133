"""GGUF checkpoints (llama.cpp's single-file format), read the way transformers reads them, one tensor at a time.

transformers loads a GGUF whole (`from_pretrained(dir, gguf_file=...)`): it dequantizes every tensor, renames it
(`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`, gguf-py's name map) and undoes llama.cpp's
layout changes (its per-architecture TensorProcessor: Llama's q/k rotary permutation, BLOOM's fused qkv...).
Here the same config, name map and processors are applied per tensor, to the memory-mapped file (its tensor
table: gguf_reader.py): a server dequantizes only its blocks' tensors, a client only embeddings, final norm and
head, so a process's memory follows what it holds, not the file. The values are transformers' own, bit for bit.

- identity: the architecture and a hash of the config and every tensor's name, type, shape and first/last bytes,
  so copies of one file meet in one swarm whatever their path (identity.py).
- fingerprint of a block: the same summary over that block's tensors.

What a GGUF cannot give is a `GGUFError` (a ValueError: one line, exit code 2 in the CLI): a file that is not a
readable GGUF (truncated, not GGUF), an architecture transformers does not read, or a quantization type gguf-py
cannot dequantize.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from swarmlm.kernels import available as kernels_available
from swarmlm.model.packed import PACKED_TYPES, PackedTensor, packed_from_numpy

log = logging.getLogger(__name__)
_noticed: set[str] = set()  # quantization types already reported as dequantized (one line per type per process)
SAMPLE_BYTES = 32  # raw bytes read at each end of every tensor for its fingerprint
CONFIG_CACHE = Path.home() / ".cache" / "swarmlm" / "gguf-configs"  # transformers' config, tokenizer per GGUF content


class GGUFError(ValueError):
    """A GGUF file this process cannot serve: the message names the file and what is missing."""


def is_gguf(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


class GGUFCheckpoint:
    """One GGUF file: its transformers config, the HF name of each of its tensors, and per-tensor reads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fields, self.tensors = _table(path)
        self.architecture = str(fields.get("general.architecture") or "?")
        self.config = _config(path, self.architecture)
        self.processor = _processor(self.architecture, self.config)
        self.hf_to_gguf = _hf_names(self.config, self.processor, self.tensors)
        _check_quant_types(path, self.tensors.values())
        self.dequantized_bytes = 0  # float32 bytes materialised so far by read(): what this process took in
        self.packed_read_bytes = 0  # file bytes copied so far by read_packed()

    def tokenizer(self):
        """transformers' tokenizer of the file (with its chat template), converted once per machine and kept."""
        from transformers import AutoTokenizer

        saved = CONFIG_CACHE / f"{_content_key(self.path)}-tokenizer"
        if not (saved / "tokenizer_config.json").is_file():
            tokenizer = AutoTokenizer.from_pretrained(self.path.parent, gguf_file=self.path.name)
            tmp = saved.with_name(f"{saved.name}.{os.getpid()}.tmp")
            tokenizer.save_pretrained(tmp)
            try:
                os.replace(tmp, saved)
            except OSError:  # another process saved it first
                shutil.rmtree(tmp, ignore_errors=True)
            return tokenizer
        return AutoTokenizer.from_pretrained(saved)

    @property
    def name(self) -> str:
        return str(self.path)

    def keys(self) -> list[str]:
        return sorted(self.hf_to_gguf)

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """The named tensors, dequantized to float32 as transformers would (each copied out of the mapping)."""
        return {key: self._read(key) for key in keys}

    def _read(self, key: str) -> torch.Tensor:
        tensor = self.tensors[self.hf_to_gguf[key]]
        from gguf import dequantize

        weights = dequantize(tensor.data, tensor.tensor_type)
        weights = self.processor.process(weights=weights, name=tensor.name, tensor_key_mapping={},
                                         parsed_parameters={"tensors": {}}).weights
        out = torch.from_numpy(np.array(weights, dtype=np.float32, copy=True))
        self.dequantized_bytes += out.nbytes
        return out

    def packable(self, key: str) -> bool:
        """Is the tensor a matrix in a type with packed kernels (model/packed.py)?"""
        tensor = self.tensors[self.hf_to_gguf[key]]
        if len(tensor.shape) != 2 or tensor.tensor_type.name in ("F32", "F64"):
            return False
        if not kernels_available():  # no C compiler here: dequantized (said once, by kernels.available)
            return False
        if tensor.tensor_type.name not in PACKED_TYPES:
            if tensor.tensor_type.name not in _noticed:
                _noticed.add(tensor.tensor_type.name)
                log.warning("%s: %s tensors have no packed kernel here: dequantized to float32", self.path.name,
                            tensor.tensor_type.name)
            return False
        return True

    def packed_bytes(self, key: str) -> int:
        """Bytes the tensor takes in the file (and, kept packed, in memory)."""
        return int(self.tensors[self.hf_to_gguf[key]].data.nbytes)

    def read_packed(self, key: str) -> PackedTensor | None:
        """The matrix in the file's own blocks, its rows in transformers' order (copied out of the mapping), or None
        when transformers' layout change for it is not a reordering of whole rows (then read() it)."""
        tensor = self.tensors[self.hf_to_gguf[key]]
        order = _row_order(self.processor, tensor)
        if order is False:
            return None
        raw = tensor.data if order is None else tensor.data[order]
        self.packed_read_bytes += int(raw.nbytes)
        return packed_from_numpy(tensor.tensor_type.name, raw, int(tensor.shape[0]), f"{self.path.name}:{tensor.name}")

    def release_pages(self) -> None:
        """Drop the file's pages this process touched from its resident memory (what was read is copied out; the
        pages stay in the OS page cache): otherwise they count in the server's RSS beside the copies."""
        import mmap

        base = next(iter(self.tensors.values())).data if self.tensors else None
        while base is not None and not hasattr(base, "_mmap"):
            base = base.base
        mapping = getattr(base, "_mmap", None)
        if mapping is not None and hasattr(mapping, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            mapping.madvise(mmap.MADV_DONTNEED)

    def summary(self, key: str) -> bytes:
        """Name, quantization type, shape and the first/last raw bytes of one tensor (a few bytes read)."""
        tensor = self.tensors[self.hf_to_gguf[key]]
        raw = tensor.data.reshape(-1).view(np.uint8)
        head = f"{key}|{tensor.tensor_type.name}|{list(map(int, tensor.shape))}|".encode()
        return head + raw[:SAMPLE_BYTES].tobytes() + raw[-SAMPLE_BYTES:].tobytes()

    def identity(self) -> str:
        config = {k: v for k, v in self.config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
        digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
        for key in self.keys():
            digest.update(self.summary(key))
        return f"{self.config.model_type}-gguf-{digest.hexdigest()[:12]}"


@functools.lru_cache(maxsize=8)
def _open(path: str, size: int, mtime_ns: int) -> GGUFCheckpoint:
    return GGUFCheckpoint(Path(path))


def open_gguf(path: str | Path) -> GGUFCheckpoint:
    """The checkpoint of a GGUF file, parsed once per process (parsing its metadata takes seconds)."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    stat = path.stat()
    return _open(str(path), stat.st_size, stat.st_mtime_ns)


def _table(path: Path):
    from swarmlm.model.gguf_reader import read_table

    try:
        return read_table(path)  # memory-mapped: tensors are views of the file until dequantized
    except (ValueError, OSError) as exc:
        raise GGUFError(f"{path}: not a readable GGUF file (truncated or corrupt?): {exc}") from None


def _config(path: Path, architecture: str) -> PretrainedConfig:
    """transformers' config of the file, remembered per file content: transformers parses the whole metadata
    again (tens of seconds on a busy machine for a 49k-token vocabulary), once per machine is enough."""
    from swarmlm.model.families import family_for

    cached = CONFIG_CACHE / f"{_content_key(path)}.json"
    if cached.is_file():
        config = AutoConfig.for_model(**json.loads(cached.read_text()))
    else:
        try:
            config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        except ValueError as exc:
            if "not supported" in str(exc):
                raise GGUFError(f"{path}: GGUF architecture {architecture!r} is not one transformers reads") from None
            raise GGUFError(f"{path}: {exc}") from None
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(config.to_json_string(use_diff=False))
        os.replace(tmp, cached)
    try:
        family_for(config).configure(config)
    except ValueError as exc:
        raise GGUFError(f"{path}: GGUF architecture {architecture!r}: {exc}") from None
    return config


def _content_key(path: Path) -> str:
    """A name for the file's content (its size, first and last MiB): the same for every copy, cheap to compute."""
    digest = hashlib.sha256(str(path.stat().st_size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, path.stat().st_size - (1 << 20)))
        digest.update(f.read())
    return digest.hexdigest()[:32]


def _processor(architecture: str, config: PretrainedConfig):
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())


def _hf_names(config: PretrainedConfig, processor, tensors: dict) -> dict[str, str]:
    """HF parameter name -> GGUF tensor name, for the tensors the file has.

    transformers' get_gguf_hf_weights_map asks gguf-py's name map for every parameter of the model, then again for
    every submodule's parameters under their shorter names (BLOOM's GGUF names BloomModel's, not BloomForCausalLM's),
    the names of the whole model first. The same here in one pass: for each parameter, its name without 0, 1, 2...
    leading components; the fewest stripped wins. (transformers rebuilds the name map per submodule: ~20 s.)"""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    with torch.device("meta"):  # names only: no weights allocated
        model = AutoModelForCausalLM.from_config(config)
    model_type = _GGUF_MODEL_TYPE.get(config.model_type, config.model_type)
    arch = next((k for k, v in MODEL_ARCH_NAMES.items() if v == model_type), None)
    if arch is None:  # let transformers say what it says about it
        return {hf: name for name, hf in get_gguf_hf_weights_map(model, processor).items() if name in tensors}
    name_map = get_tensor_name_map(arch, config.num_hidden_layers)
    found: list[tuple[int, str, str]] = []  # (components stripped, gguf name, hf name)
    for hf_name in model.state_dict():
        stem, dot, suffix = processor.preprocess_name(hf_name).rpartition(".")
        if suffix not in ("weight", "bias"):
            stem, dot, suffix = processor.preprocess_name(hf_name), "", ""
        parts = stem.split(".")
        for stripped in range(len(parts)):
            gguf_name = name_map.get_name(".".join(parts[stripped:]))
            if gguf_name is not None:
                found.append((stripped, gguf_name + dot + suffix, hf_name))
    gguf_to_hf: dict[str, str] = {}
    for _, gguf_name, hf_name in sorted(found, key=lambda f: f[0]):
        gguf_to_hf.setdefault(gguf_name, hf_name)
    return {hf: name for name, hf in gguf_to_hf.items() if name in tensors}


def _row_order(processor, tensor) -> np.ndarray | None | bool:
    """How transformers' processor reorders the matrix's rows: None (it does not), an index array (row i of the
    result is row order[i] of the file), or False (it does more than reorder whole rows). Found by processing row
    numbers: a [rows, 1] probe first (reshapes of the rows alone, e.g. Llama's q/k permutation), else one of the real
    width (BLOOM's fused qkv is reshaped with the hidden size)."""
    rows, cols = int(tensor.data.shape[0]), int(tensor.shape[0])
    for width in (1, cols):
        probe = np.repeat(np.arange(rows, dtype=np.float32)[:, None], width, axis=1)
        try:
            out = np.asarray(processor.process(weights=probe, name=tensor.name, tensor_key_mapping={},
                                               parsed_parameters={"tensors": {}}).weights)
        except (ValueError, IndexError):
            continue
        if out.shape != probe.shape or not (out == out[:, :1]).all():
            return False
        order = out[:, 0].astype(np.int64)
        if not np.array_equal(np.sort(order), np.arange(rows)):
            return False
        return None if np.array_equal(order, np.arange(rows)) else order
    return False


# transformers' model_type -> gguf-py's architecture name, where they differ (as get_gguf_hf_weights_map)
_GGUF_MODEL_TYPE = {"cohere": "command-r", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gemma3_text": "gemma3",
                    "umt5": "t5", "minimax_m2": "minimax-m2", "gpt_oss": "gpt-oss"}


def _check_quant_types(path: Path, tensors) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits  # gguf-py's registry of the types it dequantizes

    plain = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
    for tensor in tensors:
        if tensor.tensor_type not in plain and tensor.tensor_type not in _type_traits:
            raise GGUFError(f"{path}: tensor {tensor.name} is {tensor.tensor_type.name}, a quantization type "
                            "gguf-py cannot dequantize")
