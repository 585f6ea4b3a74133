"""Every event loop swarmlm makes: uvloop's (libuv) by default, asyncio's own when asked for.

Where the loops are: a server's main loop (`run`: gRPC, the framed step port, the scheduler), the client's loop
thread (client/channels.py), each DHT node's thread (swarm/dht_thread.py), each P2P daemon's thread
(swarm/p2p_link.py), and the gateway's (uvicorn, told the same choice: cli/api_cmd.py).

Why uvloop: a decode hop is mostly the stack's wake-ups, not bytes (docs/RESULTS-hop.md), and libuv's loop (C)
handles each with less work than asyncio's pure-Python selector loop: 5-18 % less per-hop overhead on tiny-bloom,
never measurably slower (Round 14 there, per benchmark).

`SWARMLM_EVENT_LOOP=asyncio` forces asyncio's loop in this process and in every swarmlm process it starts (they
inherit the environment): for A/B measurements, and for debugging (asyncio's debug mode, its pure-Python stacks).
It is read here, where a loop is made, because the client's and the DHT's loops are made inside library code that
no command line reaches; an unknown value is an error, not a silent default."""
from __future__ import annotations

import asyncio
import importlib.util
import os
from typing import Coroutine, Literal, TypeVar

ENV = "SWARMLM_EVENT_LOOP"
CHOICES = ("auto", "uvloop", "asyncio")  # auto: uvloop if it is installed (it is a dependency), else asyncio
LoopKind = Literal["uvloop", "asyncio"]  # also uvicorn's names for the two loops (its `loop=` option)
T = TypeVar("T")


def kind() -> LoopKind:
    """The loop this process makes, by SWARMLM_EVENT_LOOP (unset: auto)."""
    wanted = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if wanted not in CHOICES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: expected one of {', '.join(CHOICES)}")
    if wanted == "asyncio":
        return "asyncio"
    if importlib.util.find_spec("uvloop") is None:
        if wanted == "uvloop":
            raise ImportError(f"{ENV}=uvloop, but uvloop is not installed (pip install uvloop)")
        return "asyncio"
    return "uvloop"


def new_loop() -> asyncio.AbstractEventLoop:
    """A new event loop of `kind()` (not set as any thread's current loop: the caller runs it)."""
    if kind() == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run(main: Coroutine[object, object, T]) -> T:
    """`asyncio.run(main)` on a loop of `kind()`."""
    with asyncio.Runner(loop_factory=new_loop) as runner:
        return runner.run(main)


def name_of(loop: asyncio.AbstractEventLoop) -> LoopKind:
    """Which of the two a running loop is (what a server reports in its ready line)."""
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
