"""The compute profile: what `measure` fits from a stage's step times, on a clock the test controls.

How well a profile predicts real step times on this machine is a timing claim, measured by
`benchmarks/profile_accuracy.py` (it needs a quiet machine; a test must pass on a busy one).
"""
from __future__ import annotations

import types

import pytest
import torch

from swarmlm.perf import profile as profile_module
from swarmlm.perf.profile import measure
from swarmlm.server.stage import Stage
from swarmlm.types import BlockRange

# the cost model the clock charges, per block: prefill A * tokens + B, decode D per token
A, B, D = 2e-4, 3e-3, 5e-4


class ChargedStage:
    """A real stage whose every call advances the test's clock by the cost model above (and nothing else does)."""

    def __init__(self, stage: Stage, clock: list[float]) -> None:
        self.stage, self.clock = stage, clock
        self.blocks, self.config, self.dtype, self.hidden_size = stage.blocks, stage.config, stage.dtype, stage.hidden_size

    def forward(self, blocks, hidden, mask):
        self.clock[0] += blocks.length * (A * hidden.shape[1] + B)
        return self.stage.forward(blocks, hidden, mask)

    def new_state(self, blocks, batch):
        return self.stage.new_state(blocks, batch)

    def step(self, state, hidden, new_mask):
        tokens = hidden.shape[1]
        self.clock[0] += self.blocks.length * (D if tokens == 1 else A * tokens + B)
        return self.stage.step(state, hidden, new_mask)


def test_measure_fits_prefill_line_and_decode_time_per_block(tiny_bloom, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(profile_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    torch.set_num_threads(1)
    stage = ChargedStage(Stage(tiny_bloom, BlockRange(1, 4)), clock)
    profile = measure(stage, lengths=(16, 64), decode_steps=5, repeats=3)
    assert profile.prefill_a_s == pytest.approx(A) and profile.prefill_b_s == pytest.approx(B)
    assert profile.decode_s == pytest.approx(D)
    assert profile.prefill_s(100) == pytest.approx(A * 100 + B)
