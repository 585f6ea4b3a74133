"""Which model a process serves or uses, and which weights.

- identity: one swarm per model, whatever the path. A hub id names itself (`org/name`, `org/name@revision` when a
  revision is pinned); a directory is named by a short hash of its `config.json` (canonical JSON, without the
  fields that change when the same model is re-saved), so differently named copies of one checkpoint meet in one
  DHT namespace (`dht_prefix`).
- fingerprint: which weights. Per block, a hash of its tensors' names, dtypes and shapes plus a few sampled values
  (the first and last few elements of each tensor, read through safetensors slices: cheap for any size). A server
  announces the fingerprint of its range; a client computes the same for that range from its own checkpoint and
  refuses a server whose weights differ (another seed, a fine-tune, another dtype under the same name).
- a GGUF file: both come from its config and its tensors' names, types, shapes and raw bytes (model/gguf.py).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import re

import torch
from safetensors import safe_open

from swarmlm.model.checkpoint import GGUFTensorIndex, ModelRef, load_config, tensor_index
from swarmlm.model.gguf import open_gguf
from swarmlm.model.families import family_for
from swarmlm.model.source import resolve

log = logging.getLogger(__name__)

_VOLATILE = ("_name_or_path", "transformers_version")  # differ between copies of one model
SAMPLE = 8  # elements read at each end of every tensor


def model_identity(model: ModelRef) -> str:
    source = resolve(model)
    if source.gguf is not None:
        return open_gguf(source.gguf).identity()  # from its config and tensors: any copy of the file, any path
    if source.is_hub:
        return source.repo_id + (f"@{source.revision}" if source.revision not in (None, "main") else "")
    config = json.loads(source.file("config.json").read_text())
    for key in _VOLATILE:
        config.pop(key, None)
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"))
    kind = re.sub(r"[^A-Za-z0-9_]", "", str(config.get("model_type", "model"))) or "model"
    return f"{kind}-{hashlib.sha256(canonical.encode()).hexdigest()[:12]}"


def dht_prefix(model: ModelRef) -> str:
    """The DHT namespace of the model's swarm: its identity in the characters DHT keys allow."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", model_identity(model).replace("/", "--"))


class Fingerprints:
    """Per-block fingerprints of one checkpoint, computed on demand and remembered."""

    def __init__(self, model: ModelRef) -> None:
        self.source = resolve(model)
        config = load_config(self.source)
        self.adapter = family_for(config)
        self.num_blocks = int(config.num_hidden_layers)
        self.index = tensor_index(self.source)
        self.prefix = self.index.stack_prefix(self.adapter)
        self._blocks: dict[int, bytes] = {}

    def block_keys(self, block: int) -> tuple[str, list[str]]:
        prefix = self.prefix + self.adapter.block_prefix().format(block)
        return prefix, self.index.keys_under(prefix)

    def available(self, start: int, end: int) -> bool:
        """True if the shards holding blocks [start, end) are local (a hub client may not have them)."""
        return all(self.index.is_local(k) for b in range(start, end) for k in self.block_keys(b)[1])

    def block(self, block: int) -> bytes:
        if block not in self._blocks:
            prefix, keys = self.block_keys(block)
            if isinstance(self.index, GGUFTensorIndex):  # raw (quantized) bytes: nothing dequantized
                self._blocks[block] = hashlib.sha256(b"".join(self.index.gguf.summary(k) for k in keys)).digest()
                return self._blocks[block]
            by_file: dict[str, list[str]] = {}
            for key in keys:
                by_file.setdefault(self.index.shard_of[key], []).append(key)
            summaries: dict[str, bytes] = {}
            for filename, names in by_file.items():
                with safe_open(self.source.file(filename), framework="pt") as f:
                    for key in names:
                        summaries[key] = _tensor_summary(key[len(prefix):], f.get_slice(key))
            # in key order: the same weights sharded differently give the same fingerprint
            self._blocks[block] = hashlib.sha256(b"".join(summaries[k] for k in sorted(summaries))).digest()
        return self._blocks[block]

    def range(self, start: int, end: int) -> str:
        """Fingerprint of blocks [start, end): what a server serving exactly that range announces."""
        if not 0 <= start < end <= self.num_blocks:
            raise ValueError(f"blocks [{start}, {end}) outside the model's [0, {self.num_blocks})")
        return hashlib.sha256(b"".join(self.block(b) for b in range(start, end))).hexdigest()[:16]


def _tensor_summary(name: str, tensor_slice) -> bytes:
    shape = list(tensor_slice.get_shape())
    head = f"{name}|{tensor_slice.get_dtype()}|{shape}|".encode()
    if not shape or 0 in shape:
        return head
    # the first and the last SAMPLE elements along the last axis (one row: a few bytes read, whatever the size)
    first = tuple(slice(0, 1) for _ in shape[:-1]) + (slice(0, min(SAMPLE, shape[-1])),)
    last = tuple(slice(n - 1, n) for n in shape[:-1]) + (slice(max(0, shape[-1] - SAMPLE), shape[-1]),)
    values = [tensor_slice[first], tensor_slice[last]]
    return head + b"".join(_raw_bytes(v) for v in values)


def _raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


class WeightsCheck:
    """The client's side: does a server's announced fingerprint match this checkpoint's for the server's range?

    Called with a record's range and fingerprint; returns why the server is refused, or None. Blocks whose shards
    this client does not have locally (a hub client downloads only its own) cannot be checked: they pass, once
    logged."""

    def __init__(self, model: ModelRef) -> None:
        self.fingerprints = Fingerprints(model)
        self._verdicts: dict[tuple[int, int, str], str | None] = {}  # called on every refresh of the swarm view

    def __call__(self, start: int, end: int, fingerprint: str) -> str | None:
        key = (start, end, fingerprint)
        if key not in self._verdicts:
            if len(self._verdicts) > 4096:  # bounded: peers choose what they announce
                self._verdicts.clear()
            self._verdicts[key] = self._check(start, end, fingerprint)
        return self._verdicts[key]

    def _check(self, start: int, end: int, fingerprint: str) -> str | None:
        if not 0 <= start < end <= self.fingerprints.num_blocks:
            return f"it serves blocks [{start}, {end}), outside this model's [0, {self.fingerprints.num_blocks})"
        if not self.fingerprints.available(start, end):
            log.info("weights of blocks [%d, %d) not checked: their shards are not local", start, end)
            return None
        want = self.fingerprints.range(start, end)
        if fingerprint != want:
            return (f"its weights fingerprint for blocks [{start}, {end}) is {fingerprint[:32]!r}, this checkpoint's "
                    f"is {want!r}: it serves other weights under this model's name")
        return None


@functools.lru_cache(maxsize=32)
def range_fingerprint(model: str, start: int, end: int) -> str:
    """The fingerprint a server announces for blocks [start, end) of `model` (cached: announced every period)."""
    return Fingerprints(model).range(start, end)
