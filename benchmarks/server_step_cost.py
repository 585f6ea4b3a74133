"""The server's own work per framed decode step, outside the forward: how many Python calls and C calls it makes
(`--count`, sys.setprofile on the server's threads) or how much CPU it spends (default), for 1..N servers in this
process and one framed client in another (docs/RESULTS-hop.md, round 15).

    .venv/bin/python benchmarks/server_step_cost.py [--preset tiny-bloom] [--servers N] [--steps 100] [--count]

The client (a child process: its work is not in these figures) opens a session, prefills, takes 5 steps, then the
measured `--steps` decode steps; the servers count from its first measured step's request to its last step's reply
written (the open, the prompt and the session's end are not in it). The forward itself is left out: the span's
`Stage.step_batch` (model code, its cache and mask updates) is timed with the thread's CPU clock and subtracted
(`--count`: not counted), so what remains is the framed path: frame cut, parse, MAC, checks, the scheduler, the
reply's encode, MAC and write, pushes, and the event loop's and threads' own work between them.

`--ab REV`: alternate this tree with git revision REV (exported with `git archive`), each run a fresh process and
fresh servers, `--rounds` runs each; medians. `--one-call-ab`: the same, this tree's servers with and without the
one-call answer of a decode step (`--one-call on|off`, ServerConfig.one_call_steps; its `Stage.answer_step` counts
as the forward). `--model`: a model directory or GGUF file (e.g. SmolLM2's Q4_1) instead of a preset. Every figure is per decode step and per server (all servers summed
over N servers / N).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from source_tree import source_tree  # (benchmarks/: this script's directory)

PROMPT = list(range(10, 26))
WARM_STEPS = 5


# ---- the client (a child process) ------------------------------------------------------------------------------
def run_client(args: argparse.Namespace) -> None:
    import torch

    from swarmlm.client.model import DistributedModelForCausalLM

    torch.set_num_threads(1)
    push = {"auto": "auto", "on": True, "off": False}[args.push]
    client = DistributedModelForCausalLM.from_pretrained(model_of(args), servers=args.client.split(","), frames=True,
                                                         push=push, quant="auto")
    x = client.embed(torch.tensor([[5]]))
    for _ in range(2):  # the first session warms connections and the servers' caches; the second is measured
        with client.inference_session(max_length=len(PROMPT) + WARM_STEPS + args.steps + 1) as session:
            client.step_logits(session, torch.tensor([PROMPT]))
            for _ in range(WARM_STEPS):
                session.step(x)
            print("ready", flush=True)
            sys.stdin.readline()  # "go": the servers count from here
            walls = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                session.step(x)
                walls.append(time.perf_counter() - t0)
            print(json.dumps({"step_ms": statistics.median(walls) * 1000}), flush=True)
            sys.stdin.readline()  # "stop": the servers stopped counting


# ---- the servers' side -----------------------------------------------------------------------------------------
class Meter:
    """Per thread: CPU seconds in `Stage.step_batch` (the forward), and with `count` every Python call ('call') and
    C call ('c_call') made outside it, by function."""

    def __init__(self, count: bool) -> None:
        self.count = count
        self.on = False
        self.forward_cpu_s = 0.0
        self.calls: Counter[str] = Counter()
        self.c_calls: Counter[str] = Counter()
        self.per_thread: Counter[str] = Counter()
        self._local = threading.local()
        self._profiled: set[int] = set()

    def wrap_forward(self, stage_cls) -> None:
        """The forward: `Stage.step_batch`, or `Stage.answer_step` (the one-call answer: the span and the frame)."""
        for name in ("step_batch", "answer_step"):
            setattr(stage_cls, name, self._timed(getattr(stage_cls, name)))

    def _timed(self, inner):
        meter = self

        def forward(self, *args):
            if not meter.on:
                return inner(self, *args)
            meter.profile_this_thread()
            meter._local.inside = True
            started = time.thread_time()
            try:
                return inner(self, *args)
            finally:
                meter.forward_cpu_s += time.thread_time() - started
                meter._local.inside = False

        return forward

    def profile_this_thread(self) -> None:
        if self.count and threading.get_ident() not in self._profiled:
            self._profiled.add(threading.get_ident())
            sys.setprofile(self._event)

    def stop_profiling(self) -> None:
        sys.setprofile(None)
        self._profiled.discard(threading.get_ident())

    def _event(self, frame, event, arg) -> None:
        if not self.on or getattr(self._local, "inside", False):
            return
        if event == "call":
            code = frame.f_code
            if code.co_filename == __file__:  # (the meter's own)
                return
            self.calls[f"{code.co_qualname} ({Path(code.co_filename).name}:{code.co_firstlineno})"] += 1
            self.per_thread[threading.current_thread().name] += 1
        elif event == "c_call":
            owner = getattr(arg, "__self__", None)
            where = type(owner).__name__ if owner is not None and not isinstance(owner, type(sys)) else \
                getattr(arg, "__module__", None) or getattr(owner, "__name__", "")
            self.c_calls[f"{where}.{getattr(arg, '__qualname__', repr(arg))}"] += 1
            self.per_thread[threading.current_thread().name] += 1


def measure(args: argparse.Namespace) -> dict:
    import torch

    from swarmlm import event_loop
    from swarmlm.config import ServerConfig
    from swarmlm.model.checkpoint import load_config
    from swarmlm.server.server import Server
    from swarmlm.server.stage import Stage
    from swarmlm.swarm.local import even_split

    torch.set_num_threads(1)
    meter = Meter(args.count)
    meter.wrap_forward(Stage)
    model_dir = model_of(args)
    ranges = even_split(int(load_config(model_dir).num_hidden_layers), args.servers)
    servers, loops = [], []
    for blocks in ranges:
        server = Server(ServerConfig(model_dir=model_dir, blocks=blocks, drain_timeout_s=0.0, threads=1,
                                     one_call_steps=args.one_call == "on"))
        loop = event_loop.new_loop()
        threading.Thread(target=loop.run_forever, name=f"loop {blocks}", daemon=True).start()
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(timeout=300)
        servers.append(server)
        loops.append(loop)

    def on_loops(fn) -> None:
        for loop in loops:
            asyncio.run_coroutine_threadsafe(_call(fn), loop).result(timeout=30)

    client = subprocess.Popen([sys.executable, __file__, "--client", ",".join(s.address for s in servers),
                               *model_args(args), "--steps", str(args.steps), "--push", args.push],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=os.environ)
    result = {}
    try:
        for session in range(2):
            assert client.stdout.readline().strip() == "ready"
            meter.forward_cpu_s, meter.calls, meter.c_calls, meter.per_thread = 0.0, Counter(), Counter(), Counter()
            load = os.getloadavg()[0]
            on_loops(meter.profile_this_thread)
            cpu0 = time.process_time()
            meter.on = True
            client.stdin.write("go\n")
            client.stdin.flush()
            got = json.loads(client.stdout.readline())
            meter.on = False
            cpu = time.process_time() - cpu0
            on_loops(meter.stop_profiling)
            client.stdin.write("stop\n")
            client.stdin.flush()
            per_step = args.steps * args.servers
            result = {
                "load": load,
                "client step (ms)": got["step_ms"],
                "server CPU outside the forward (ms)": (cpu - meter.forward_cpu_s) / per_step * 1000,
                "forward CPU (ms)": meter.forward_cpu_s / per_step * 1000,
                "server CPU in all (ms)": cpu / per_step * 1000,
            }
            if args.count:
                result["Python calls"] = sum(meter.calls.values()) / per_step
                result["C calls"] = sum(meter.c_calls.values()) / per_step
                result["by thread"] = {k: v / per_step for k, v in meter.per_thread.items()}
                result["top Python"] = [(k, v / per_step) for k, v in meter.calls.most_common(args.top)]
                result["top C"] = [(k, v / per_step) for k, v in meter.c_calls.most_common(args.top)]
        client.wait(timeout=60)
    finally:
        if client.poll() is None:
            client.kill()
        for server, loop in zip(servers, loops):
            asyncio.run_coroutine_threadsafe(server.stop(), loop).result(timeout=60)
            loop.call_soon_threadsafe(loop.stop)
    return result


async def _call(fn) -> None:
    fn()


def model_of(args: argparse.Namespace) -> str:
    from swarmlm.model.random_checkpoint import default_checkpoint

    return args.model or str(default_checkpoint(args.preset))


def model_args(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model] if args.model else ["--preset", args.preset]


def compare(args: argparse.Namespace) -> None:
    """Runs alternating between this tree and `--ab` REV (or, `--one-call-ab`, this tree's servers with and without
    the one-call answer), each a fresh process; medians."""
    repo = Path(__file__).resolve().parent.parent
    with source_tree(args.ab) if args.ab else contextlib.nullcontext() as base:
        if args.ab:
            variants = {"this tree": (str(repo), "on"), args.ab: (base, "on")}
        else:
            variants = {"one call": (str(repo), "on"), "usual": (str(repo), "off")}
        runs: dict[str, list[dict]] = {name: [] for name in variants}
        print("load average at start: %.2f %.2f %.2f" % os.getloadavg(), flush=True)
        for r in range(args.rounds):
            for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                tree, one_call = variants[name]
                cmd = [sys.executable, __file__, "--json", *model_args(args), "--servers", str(args.servers),
                       "--steps", str(args.steps), "--push", args.push, *(["--count"] if args.count else []),
                       *(["--one-call", one_call] if not args.ab else [])]
                out = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=tree), cwd=tree, check=True,
                                     capture_output=True, text=True).stdout
                runs[name].append(json.loads(out.strip().splitlines()[-1]))
                print(name, {k: round(v, 4) for k, v in runs[name][-1].items() if isinstance(v, float)}, flush=True)
    names = list(variants)
    for key, value in runs[names[0]][0].items():
        if isinstance(value, float):
            a, b = (statistics.median(run[key] for run in runs[n]) for n in names)
            print(f"{key:40s} {names[0]} {a:9.4f}   {names[1]} {b:9.4f}")
    print("load average at end: %.2f %.2f %.2f" % os.getloadavg(), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny-bloom")
    ap.add_argument("--model", help="a model directory or GGUF file instead of --preset (served with --quant auto)")
    ap.add_argument("--one-call", choices=("on", "off"), default="on",
                    help="the servers' one-call answer of a decode step (ServerConfig.one_call_steps)")
    ap.add_argument("--one-call-ab", action="store_true", help="this tree's servers with and without the one-call "
                    "answer, runs alternating")
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--steps", type=int, default=100, help="measured decode steps")
    ap.add_argument("--push", choices=("auto", "on", "off"), default="auto", help="the client's push setting")
    ap.add_argument("--count", action="store_true", help="count Python and C calls (slows the step: no times then)")
    ap.add_argument("--top", type=int, default=40, help="--count: the most frequent calls shown")
    ap.add_argument("--ab", metavar="REV", help="this tree against git revision REV, runs alternating")
    ap.add_argument("--rounds", type=int, default=4, help="--ab: runs per tree")
    ap.add_argument("--json", action="store_true", help="one run, its figures as one JSON line")
    ap.add_argument("--client", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        return run_client(args)
    if args.ab or args.one_call_ab:
        return compare(args)
    result = measure(args)
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        if isinstance(value, list):
            print(f"{key} (per step and server):")
            for name, n in value:
                print(f"  {n:7.2f}  {name}")
        else:
            print(f"{key:40s} {value}")


if __name__ == "__main__":
    main()
