"""A server measures its own per-block compute times at start-up (cached on disk), to announce and to plan with.

Fits the performance model's ComputeProfile: prefill seconds per block = a * tokens + b (two lengths, least
squares over repeats), decode seconds per block per token (median of single-token steps), and the same decode
step with 4 and 16 rows (sessions batched in one forward: the compute-contention term f(b) of perf/model.py).

perf sits below server in the layering (docs/ARCHITECTURE.md): what is measured is described by the `Measurable`
protocol, which the server's `Stage` satisfies; the server builds the stage and hands it in.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from swarmlm.perf.model import CONTENTION_ROWS, ComputeProfile
from swarmlm.types import BlockRange

log = logging.getLogger(__name__)
PROFILE_VERSION = 4  # bump when the measurement changes: cached profiles are redone


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class Measurable(Protocol):
    """The compute a profile measures: a span of blocks, run stateless (prefill) or in a session (decode)."""

    blocks: BlockRange
    config: Any  # the model's transformers config (its shapes key the cache)
    dtype: torch.dtype
    hidden_size: int

    def forward(self, blocks: BlockRange, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor: ...

    def new_state(self, blocks: BlockRange, batch: int) -> Any: ...

    def step(self, state: Any, hidden: torch.Tensor, new_mask: torch.Tensor) -> torch.Tensor: ...


def profile_key(stage: Measurable, threads: int) -> str:
    """Same model shapes, dtype, threads, span length and machine -> same profile."""
    parts = [
        json.dumps(stage.config.to_dict(), sort_keys=True, default=str), str(stage.dtype), str(threads),
        str(stage.blocks.length), _cpu_name(), torch.__version__, str(PROFILE_VERSION),
    ]
    packed = getattr(stage, "packed_types", "")  # packed weights run other kernels; float ones keep older keys valid
    if packed:
        parts.append(f"packed={packed}")
    if getattr(stage, "mmap", False):  # weights read from the file's mapping run slower (checkpoint.load_blocks)
        parts.append("mmap")
    kv = getattr(stage, "kv_dtype", None)  # a cache narrower than the blocks' dtype: attention reads other bytes
    if kv is not None and kv != stage.dtype:
        parts.append(f"kv={kv}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def measure(stage: Measurable, lengths: tuple[int, int] = (16, 128), decode_steps: int = 8, repeats: int = 3) -> ComputeProfile:
    blocks = stage.blocks
    n = blocks.length
    h = stage.hidden_size
    gen = torch.Generator().manual_seed(0)

    def prefill_s(n_tokens: int) -> float:
        x = torch.randn(1, n_tokens, h, generator=gen)
        t0 = time.perf_counter()
        stage.forward(blocks, x, torch.ones(1, n_tokens, dtype=torch.long))
        return time.perf_counter() - t0

    for n_tokens in lengths:  # warm-up: first calls at a new size allocate, and would skew the fit
        prefill_s(n_tokens)
    # the median per length is robust to a burst of load elsewhere; two points define the line
    medians = [statistics.median(prefill_s(n_tokens) / n for _ in range(repeats)) for n_tokens in lengths]
    a, b = _fit_line(list(lengths), medians)

    # decode with 1, 4 and 16 rows after a short prompt; one step of each size in turn, so that a change of the
    # machine's load during the measurement shifts all three alike and their ratios (f(b)) stay meaningful
    sizes = (1, *CONTENTION_ROWS)
    states = []
    for rows in sizes:
        state = stage.new_state(blocks, rows)
        stage.step(state, torch.randn(rows, lengths[0], h, generator=gen),
                   torch.ones(rows, lengths[0], dtype=torch.long))
        states.append(state)
    times: list[list[float]] = [[] for _ in sizes]
    for _ in range(decode_steps + 1):
        for rows, state, out in zip(sizes, states, times):
            x = torch.randn(rows, 1, h, generator=gen)
            t0 = time.perf_counter()
            stage.step(state, x, torch.ones(rows, 1, dtype=torch.long))
            out.append(time.perf_counter() - t0)
    decode, d4, d16 = (statistics.median(t[1:]) / n for t in times)  # the first step of each warms up
    return ComputeProfile(prefill_a_s=max(a, 0.0), prefill_b_s=max(b, 0.0), decode_s=decode,
                          decode_4rows_s=d4, decode_16rows_s=d16)


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return a, my - a * mx


def cached_profile(stage: Measurable, threads: int, cache_dir: str | Path | None = None, refresh: bool = False) -> ComputeProfile:
    cache_dir = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "swarmlm" / "profiles"
    path = cache_dir / f"{profile_key(stage, threads)}.json"
    if path.is_file() and not refresh:
        try:
            profile = ComputeProfile(**json.loads(path.read_text()))
            log.info("compute profile from %s (measured on an earlier start)", path)
            return profile
        except (ValueError, TypeError):
            pass  # a corrupt cache entry is measured again
    torch.set_num_threads(threads)
    log.info("measuring compute: prefill at 16 and 128 tokens, 8 decode steps of 1, 4 and 16 rows (cached for the "
             "next start in %s)", cache_dir)
    t0 = time.perf_counter()
    profile = measure(stage)
    log.info("measured in %.1f s: decode %.2f ms/token per block (f(4) = %.2f, f(16) = %.2f), prefill %.3f ms/token "
             "+ %.2f ms per block", time.perf_counter() - t0, profile.decode_s * 1e3, profile.load_factor(4),
             profile.load_factor(16), profile.prefill_a_s * 1e3, profile.prefill_b_s * 1e3)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # servers profiling the same shapes at once each write their own
    tmp.write_text(json.dumps({"prefill_a_s": profile.prefill_a_s, "prefill_b_s": profile.prefill_b_s,
                               "decode_s": profile.decode_s, "decode_4rows_s": profile.decode_4rows_s,
                               "decode_16rows_s": profile.decode_16rows_s}))
    tmp.replace(path)
    return profile

