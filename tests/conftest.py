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


def _dump_client_tasks(signum, frame) -> None:
    """`kill -USR1 <pytest pid>`: every asyncio task of the client's loop, with its stack, to stderr (to find
    where a hung test waits; py-spy sees only the idle loop)."""
    import asyncio
    import sys

    from swarmlm.client.transport import LoopThread

    loop_thread = LoopThread._instance
    if loop_thread is None:
        return

    def dump() -> None:
        out = sys.__stderr__  # not pytest's capture
        for task in asyncio.all_tasks(loop_thread.loop):
            print(f"--- {task!r}", file=out)
            task.print_stack(file=out)
        out.flush()

    loop_thread.loop.call_soon_threadsafe(dump)


import signal as _signal  # noqa: E402

_signal.signal(_signal.SIGUSR1, _dump_client_tasks)
