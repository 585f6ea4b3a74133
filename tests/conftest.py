"""Shared fixtures: tiny checkpoints written once per test run, and local swarms that are always stopped."""
from __future__ import annotations

import pytest

from swarmlm.model.init import init_checkpoint


@pytest.fixture(scope="session")
def tiny_bloom(tmp_path_factory) -> str:
    # a small shard size, so loading from a sharded index is exercised too
    return str(init_checkpoint("tiny-bloom", tmp_path_factory.mktemp("tiny-bloom"), seed=1, max_shard_size="100KB"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return str(init_checkpoint("tiny-llama", tmp_path_factory.mktemp("tiny-llama"), seed=2))


@pytest.fixture(scope="session")
def checkpoints(tiny_bloom, tiny_llama) -> dict[str, str]:
    return {"bloom": tiny_bloom, "llama": tiny_llama}
