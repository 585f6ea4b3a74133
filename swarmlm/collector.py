"""Python's garbage collector in swarmlm's long-running processes: start-up's heap frozen, each collection timed.

Why freeze: a process that has loaded a model holds hundreds of thousands of container objects (torch's and
transformers' modules, their dicts, the imported modules; 410k in a SmolLM2 client) that live as long as it does.
Every full (generation 2) collection walks all of them, and one comes whenever the objects that survived younger
collections grow past a quarter of the old ones: a SmolLM2 client stalled ~0.21 s on one token in each 8000 that
way (docs/RESULTS-hop.md Round 20); a server's full collection (the trimmer's, docs/FAILURES.md) took 0.2-0.37 s
on its event loop. `gc.freeze()` moves every object
alive into a permanent generation that collections never walk, so a full collection costs what has been made since
start-up, not the model. Reference counting still frees frozen objects whose count drops to 0; only a cycle among
frozen objects is never collected, so a process that replaces its start-up heap (a server moving to other blocks)
thaws it first (`thawed`).

Only long-running processes we own freeze (the server, `swarmlm dht`, the gateway, `chat`; not `generate`: one
prompt, then exit, where the collection before freezing costs more than the pause it might spare): a library object
freezing its host's heap would decide for a program it does not know. A program that loads a
`DistributedModelForCausalLM` calls `freeze_start_up()` itself once its own start-up is done.

`CollectionTimes` counts and times each collection (gc.callbacks) per generation; a server reports it in Info
(`InfoReply.gc`, with its frozen count).
"""
from __future__ import annotations

import contextlib
import gc
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

GENERATIONS = 3  # CPython's generations 0, 1, 2 (the oldest: a full collection)


def freeze_start_up() -> int:
    """Collect once (garbage frozen now would never be freed), then freeze every object alive: collections from
    now on walk only what the process makes later. Returns the objects frozen (gc.get_freeze_count())."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextlib.contextmanager
def thawed() -> Iterator[None]:
    """The frozen objects back under collection while the start-up heap is replaced (a server's old blocks may hold
    cycles that only a collection frees), frozen again with its replacement on exit (an error too: what is alive
    then is the heap the process goes on with); nothing frozen (a server inside a test's process): nothing done."""
    frozen = gc.get_freeze_count() > 0
    gc.unfreeze()
    try:
        yield
    finally:
        if frozen:
            freeze_start_up()


@dataclass
class CollectionTimes:
    """Collections of this process since `install`, per generation: how many, their total and longest time."""

    collections: list[int] = field(default_factory=lambda: [0] * GENERATIONS)
    seconds: list[float] = field(default_factory=lambda: [0.0] * GENERATIONS)
    longest_s: list[float] = field(default_factory=lambda: [0.0] * GENERATIONS)
    _started: float = 0.0

    def callback(self, phase: str, info: dict) -> None:
        # (runs inside the collection, under the GIL: collections never overlap, so no lock)
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        g = info["generation"]
        self.collections[g] += 1
        self.seconds[g] += took
        self.longest_s[g] = max(self.longest_s[g], took)

    def snapshot(self) -> "CollectionTimes":
        """A copy (the counts go on growing)."""
        return CollectionTimes(list(self.collections), list(self.seconds), list(self.longest_s))

    def since(self, before: "CollectionTimes") -> "CollectionTimes":
        """What happened between `before` (a snapshot) and now; longest_s is the longest since install."""
        return CollectionTimes([a - b for a, b in zip(self.collections, before.collections)],
                               [a - b for a, b in zip(self.seconds, before.seconds)], list(self.longest_s))


_installed: CollectionTimes | None = None
_install_lock = threading.Lock()


def collection_times() -> CollectionTimes:
    """This process's CollectionTimes, its gc callback installed on first use (once per process)."""
    global _installed
    with _install_lock:
        if _installed is None:
            _installed = CollectionTimes()
            gc.callbacks.append(_installed.callback)
        return _installed
