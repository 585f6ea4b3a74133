"""Summary statistics every floor uses (the gateway's metrics, the bench, the simulator): on the ground floor, so
none of them imports another's module for a percentile."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100, numpy's linear interpolation) of the values that are not NaN; NaN if none."""
    finite = [v for v in values if not math.isnan(v)]
    return float(np.percentile(finite, q)) if finite else math.nan
