"""Checks the performance model's values share."""
from __future__ import annotations

import math


def check_nonneg(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{owner}.{name} must be a finite number >= 0, got {value!r}")
