"""A decode step's few values read as Python numbers instead of by torch reductions.

Right after a client slept through a server's step its caches are cold, and each small torch reduction and its read
back (`mask.all()`, `ids.min()`) cost ~10-60 us there (docs/RESULTS-hop.md round 11, RESULTS-packed.md round 12);
`tolist()` of a few values and Python's own `all` / `min` / `max` cost a fraction of that. Larger tensors (a prompt)
keep the torch reductions.
"""
from __future__ import annotations

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
