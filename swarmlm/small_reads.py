"""A decode step's few values read as Python numbers instead of by torch reductions.

Right after a client slept through a server's step its caches are cold, and each small torch reduction and its read
back (`mask.all()`, `ids.min()`) cost ~10-60 us there (docs/RESULTS-hop.md round 11, RESULTS-packed.md round 12);
`tolist()` of a few values and Python's own `all` / `min` / `max` cost a fraction of that. Larger tensors (a prompt)
keep the torch reductions. For the same reason a decode step's mask without padding is one kept tensor per shape
(`no_padding_mask`), on both ends, rather than a `torch.ones` per step.
"""
from __future__ import annotations

import functools

import torch

SMALL_VALUES = 64  # tensors of up to this many values are read in Python


def all_set(mask: torch.Tensor) -> bool:
    """No padding in this [B, T] mask (every value nonzero)?"""
    if mask.dim() == 2 and mask.numel() <= SMALL_VALUES:
        return all(all(row) for row in mask.tolist())
    return bool(mask.all())


def id_bounds(ids: torch.Tensor) -> tuple[int, int]:
    """(min, max) of a non-empty integer tensor."""
    if ids.numel() <= SMALL_VALUES:
        values = ids.reshape(-1).tolist()
        return min(values), max(values)
    low, high = torch.aminmax(ids)
    return int(low), int(high)


def no_padding_mask(b: int, t: int) -> torch.Tensor:
    """The [b, t] int64 mask of a step without padding; for a decode step's few tokens one tensor per shape, kept and
    shared (so never written: the client's chunks, history and replays and the server's stage only read or slice a
    step's mask)."""
    return _kept_ones(b, t) if b * t <= SMALL_VALUES else torch.ones(b, t, dtype=torch.long)


@functools.lru_cache(maxsize=64)  # (decode steps' shapes recur; the bound keeps odd ones from piling up)
def _kept_ones(b: int, t: int) -> torch.Tensor:
    return torch.ones(b, t, dtype=torch.long)
