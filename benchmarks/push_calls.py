"""Python calls per decode step on each server, relayed vs pushed: 3 tiny-bloom servers in this process (each on
its own event-loop thread, `in_process_server`), a counter (`sys.setprofile`) on each server's loop thread and on
the caller's thread; steps alternate between a relayed and a pushed client (framed), the counts per step printed
side by side. Every Python call right after a forward runs 10-30x slower than warm (docs/RESULTS-hop.md round 15):
what a pushed step costs the servers is mostly how many calls it makes.

Usage: .venv/bin/python benchmarks/push_calls.py [--steps 50] [--preset tiny-bloom]
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import threading

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])  # (the tests' in-process servers)
from tests.swarm_helpers import in_process_swarm  # noqa: E402

from swarmlm.client.model import DistributedModelForCausalLM  # noqa: E402
from swarmlm.model.checkpoint import load_config  # noqa: E402
from swarmlm.model.random_checkpoint import default_checkpoint  # noqa: E402
from swarmlm.swarm.local import even_split  # noqa: E402

PROMPT = list(range(10, 26))


class Counter:
    """Calls (Python functions and C functions) made on the threads it is installed on, while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.calls: collections.Counter[str] = collections.Counter()
        self.where: collections.Counter[tuple[str, str]] = collections.Counter()

    def __call__(self, frame, event, arg) -> None:
        if self.on and event in ("call", "c_call"):
            name = threading.current_thread().name
            self.calls[name] += 1
            if event == "call":
                code = frame.f_code
                self.where[(name, f"{code.co_filename.rsplit('/', 2)[-1]}:{code.co_name}")] += 1
            else:
                self.where[(name, f"C {getattr(arg, '__qualname__', arg)}")] += 1


def install(counter: Counter, loop: asyncio.AbstractEventLoop, name: str) -> None:
    def on_loop() -> None:
        threading.current_thread().name = name
        sys.setprofile(counter)
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result()
    loop.call_soon_threadsafe(on_loop)
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result()


def run(client, counter: Counter, steps: int) -> dict[str, float]:
    counter.calls.clear()
    with client.inference_session(max_length=len(PROMPT) + steps + 2) as session:
        client.step_logits(session, torch.tensor([PROMPT]))
        x = client.embed(torch.tensor([[5]]))
        session.step(x)
        counter.on = True
        for _ in range(steps):
            session.step(x)
        counter.on = False
    return {name: n / steps for name, n in counter.calls.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--preset", default="tiny-bloom")
    ap.add_argument("--top", type=int, default=0,
                    help="also the N functions whose calls per step differ most, pushed - relayed, per thread")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = str(default_checkpoint(args.preset))
    ranges = even_split(int(load_config(model_dir).num_hidden_layers), 3)
    with in_process_swarm(model_dir, ranges, threads=1) as swarm:
        counter = Counter()
        for i, server in enumerate(swarm.servers):
            install(counter, server._tasks[0].get_loop(), f"server {i + 1}")  # (its expiry loop: on its loop)
        threading.current_thread().name = "client"
        sys.setprofile(counter)
        clients = {mode: DistributedModelForCausalLM.from_pretrained(model_dir, servers=swarm.addresses,
                                                                      push=mode == "pushed", frames=True)
                   for mode in ("relayed", "pushed")}
        for client in clients.values():
            run(client, counter, 10)  # warm-up
        rows: dict[str, list[dict[str, float]]] = {mode: [] for mode in clients}
        where: dict[str, collections.Counter] = {mode: collections.Counter() for mode in clients}
        for r in range(4):
            for mode in (list(clients) if r % 2 == 0 else list(clients)[::-1]):
                counter.where.clear()
                rows[mode].append(run(clients[mode], counter, args.steps))
                where[mode].update({k: v / args.steps / 4 for k, v in counter.where.items()})
        sys.setprofile(None)
        names = sorted({n for runs in rows.values() for row in runs for n in row})
        print(f"{'calls per decode step (mean of 4 runs)':40s} {'relayed':>9s} {'pushed':>9s}")
        for name in names:
            a, b = (sum(row.get(name, 0) for row in rows[m]) / len(rows[m]) for m in ("relayed", "pushed"))
            print(f"{name:40s} {a:9.0f} {b:9.0f}")
        if args.top:
            diff = where["pushed"].copy()
            diff.subtract(where["relayed"])
            for name in names:
                print(f"\n{name}: calls per step, pushed - relayed, the {args.top} largest differences")
                ranked = sorted(((k[1], v) for k, v in diff.items() if k[0] == name), key=lambda kv: -abs(kv[1]))
                for fn, c in ranked[:args.top]:
                    print(f"  {c:+7.1f}  {fn}")


if __name__ == "__main__":
    main()
