"""Garbage-collector pauses in the decode path: the client's and every server's, with and without the start-up heap
frozen (swarmlm/collector.py), side by side.

For each swarm size (SmolLM2 Q4_1 through 1 and 3 servers on this machine, no DHT) two arms run at once, each a
swarm and a client process of its own:
- "frozen": plain `swarmlm server` processes (they freeze their start-up heap before their ready line) and a client
  that freezes its heap once its model is loaded (as `swarmlm generate`, `chat` and `api` do);
- "unfrozen": the same, through this script's `--child` wrapper, which makes `freeze_start_up` a no-op before
  swarmlm's code imports it (the product has no switch for it; only this benchmark does).
This process drives both clients over pipes, one session at a time, alternating the arms (and which goes first)
session by session: `--sessions` short sessions of `--tokens` greedy tokens each, then one long one of `--long`.
Each process keeps its own collector history (a full collection comes when the objects that survived younger ones
reach a quarter of the old), as a real client or server would: nothing collects between sessions.

Per arm it reports:
- the client's per-token latency (one `step_logits` and its argmax): mean, median, p99, max;
- per process (the client, from its own gc callback; each server, from its Info's `gc` counters: servers run with
  --publish-counters): collections per generation per 1000 tokens, the longest full collection, GC time per token;
- the time of a full collection at the end of the long session, the session still open: what the next one the
  collector starts by itself would cost there (the frozen arm's walks only what start-up did not leave);
- per session pair (the two arms' sessions run one after the other), the difference of their median latencies,
  and the median of those differences: a drifting load moves both of a pair alike;
- with `--census N` (after the timed sessions, not timed): the objects the collector tracks, by type, that one
  session of N steps adds per token while it is open, in the client and in each server (unfrozen arm: every object
  is visible to gc.get_objects there).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/gc_pauses.py [--servers 1 3] [--sessions 5] [--tokens 200]
        [--long 3000] [--census 1000] [--push off]

One torch thread per process. Prints one JSON line per arm (and per census) and a table.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = str(Path.home() / ".cache/swarmlm/gguf/SmolLM2-135M-Instruct.Q4_1.gguf")
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 2]
ARMS = ("frozen", "unfrozen")
CENSUS_TOP = 12


# ---- in the children ------------------------------------------------------------------------------------------

def type_census() -> collections.Counter:
    """Objects the collector tracks (frozen ones excepted), by type name, after a full collection: what is alive."""
    gc.collect()
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


def unfrozen(argv: list[str]) -> int:
    """`--child unfrozen <python> -m swarmlm.cli.main server ...`: a server that does not freeze its heap and writes
    its type census (JSON) to $GC_PAUSES_CENSUS-<pid>.<n> on SIGUSR1, n counting from 0."""
    import swarmlm.collector

    swarmlm.collector.freeze_start_up = lambda: 0  # (before swarmlm.server.server imports it)
    written = [0]

    def write(signum, frame) -> None:
        path = f"{os.environ['GC_PAUSES_CENSUS']}-{os.getpid()}.{written[0]}"
        Path(path + ".tmp").write_text(json.dumps(type_census()))
        os.replace(path + ".tmp", path)  # (the reader sees a whole file or none)
        written[0] += 1

    signal.signal(signal.SIGUSR1, write)
    from swarmlm.cli.main import main

    return main(argv[3:])


def client_child(arm: str, push: str, addresses: list[str]) -> int:
    """`--client ARM ADDRESS...`: a client process that answers this script's commands on stdin, one JSON line each:
    {"run": N} a session of N decode steps (its latencies and the collections during it), {"census": N} the
    objects such a session adds per token (not timed)."""
    import torch

    from swarmlm.client.model import DistributedModelForCausalLM
    from swarmlm.collector import collection_times, freeze_start_up

    torch.set_num_threads(1)
    client = DistributedModelForCausalLM.from_pretrained(MODEL, servers=addresses, quant="auto", push=push)
    session_steps(client, 16)  # warm-up: connections, first allocations
    frozen = freeze_start_up() if arm == "frozen" else 0  # (a client program does it after loading its model)
    times = collection_times()
    print(json.dumps({"ready": True, "frozen_objects": frozen}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if "run" in cmd:
            times.longest_s = [0.0, 0.0, 0.0]  # (this session's longest)
            before = times.snapshot()
            probe: dict = {"calls": 0}

            def after_last_step() -> None:  # (called after the prompt, then after the last step: the session open)
                probe["calls"] += 1
                if probe["calls"] == 2:
                    probe["end"] = times.snapshot()  # (the probe's own collection is not the session's)
                    probe["full_collection_s"] = timed_full_collection()

            lat = session_steps(client, cmd["run"], between=after_last_step if cmd.get("probe") else None)
            d = probe["end"].since(before) if "end" in probe else times.since(before)
            out = {"latencies_s": lat, "collections": d.collections, "seconds": d.seconds, "longest_s": d.longest_s,
                   "full_collection_s": probe.get("full_collection_s")}
        else:
            out = {"census": session_census(client, cmd["census"])}
        print(json.dumps(out), flush=True)
    client.close()
    return 0


def session_steps(client, tokens: int, between=None) -> list[float]:
    """One greedy session of `tokens` decode steps; the latency of each (step_logits and argmax). `between`: called
    after the prompt and after the last step, the session open (the census)."""
    import torch

    out = []
    with torch.no_grad(), client.inference_session(max_length=len(PROMPT) + tokens + 1) as session:
        logits = client.step_logits(session, torch.tensor([PROMPT]), last_only=True)
        if between:
            between()
        for _ in range(tokens):
            t0 = time.perf_counter()
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            logits = client.step_logits(session, nxt, last_only=True)
            out.append(time.perf_counter() - t0)
        if between:
            between()
    return out


def timed_full_collection() -> float:
    """How long a full collection takes now: what the next one the collector starts by itself would cost."""
    t0 = time.perf_counter()
    gc.collect()
    return time.perf_counter() - t0


def session_census(client, tokens: int) -> dict:
    """Objects per token a session of `tokens` steps adds here; after its last step (before it closes) it says so on
    stdout and waits for a line on stdin (the driver counts the servers' objects meanwhile)."""
    counts = []

    def count() -> None:
        counts.append(type_census())
        if len(counts) == 2:
            print(json.dumps({"steps_done": True}), flush=True)
            sys.stdin.readline()

    session_steps(client, tokens, between=count)
    return per_token(counts[1], counts[0], tokens)


def per_token(after: dict, before: dict, tokens: int) -> dict:
    grown = {k: (v - before.get(k, 0)) / tokens for k, v in after.items() if v - before.get(k, 0) > 0}
    top = sorted(grown.items(), key=lambda kv: -kv[1])[:CENSUS_TOP]
    return {"total_per_token": round(sum(grown.values()), 2), "top": [(k, round(v, 3)) for k, v in top]}


# ---- in the driver ----------------------------------------------------------------------------------------------

class Arm:
    """One arm: its swarm, its client process, and what its sessions measured."""

    def __init__(self, name: str, swarm, client: subprocess.Popen) -> None:
        from swarmlm.wire import swarm_pb2_grpc as pb_grpc
        from swarmlm.wire.channel import sync_channel

        self.name, self.swarm, self.client = name, swarm, client
        self.stubs = [pb_grpc.SwarmStub(sync_channel(a)) for a in swarm.addresses]
        self.latencies_s: list[float] = []
        self.long_latencies_s: list[float] = []
        self.client_gc = empty_gc()
        self.server_gc = [empty_gc() for _ in self.stubs]
        self.client_frozen = 0
        self.session_medians_s: list[float] = []  # each session's median latency, in the order run
        self.full_collection_s: float | None = None  # a full collection at the long session's end, the session open

    def ask(self, cmd: dict) -> dict:
        self.client.stdin.write(json.dumps(cmd) + "\n")
        self.client.stdin.flush()
        line = self.client.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} client ended (exit {self.client.wait()})")
        return json.loads(line)

    def server_counters(self) -> list[dict]:
        from swarmlm.wire import swarm_pb2 as pb

        out = []
        for stub in self.stubs:
            g = stub.Info(pb.InfoRequest(), timeout=30).gc
            out.append({"collections": list(g.collections), "seconds": list(g.seconds),
                        "longest_s": list(g.longest_s), "frozen_objects": g.frozen_objects})
        return out

    def session(self, tokens: int, probe: bool = False) -> list[float]:
        before = self.server_counters()
        got = self.ask({"run": tokens, "probe": probe})
        self.session_medians_s.append(statistics.median(got["latencies_s"]))
        if got["full_collection_s"] is not None:
            self.full_collection_s = got["full_collection_s"]
        add_gc(self.client_gc, got)
        for total, b, a in zip(self.server_gc, before, self.server_counters()):
            add_gc(total, {"collections": [x - y for x, y in zip(a["collections"], b["collections"])],
                           "seconds": [x - y for x, y in zip(a["seconds"], b["seconds"])],
                           # (the server's longest since it started serving, its warm-up session's included)
                           "longest_s": a["longest_s"], "frozen_objects": a["frozen_objects"]})
        return got["latencies_s"]


def empty_gc() -> dict:
    return {"collections": [0, 0, 0], "seconds": [0.0, 0.0, 0.0], "longest_s": [0.0, 0.0, 0.0], "frozen_objects": 0}


def add_gc(total: dict, delta: dict) -> None:
    total["collections"] = [t + d for t, d in zip(total["collections"], delta["collections"])]
    total["seconds"] = [t + d for t, d in zip(total["seconds"], delta["seconds"])]
    total["longest_s"] = [max(t, d) for t, d in zip(total["longest_s"], delta["longest_s"])]
    total["frozen_objects"] = delta.get("frozen_objects", total["frozen_objects"])


def latency(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"mean_ms": 1e3 * statistics.fmean(xs), "median_ms": 1e3 * statistics.median(xs),
            "p99_ms": 1e3 * xs[min(len(xs) - 1, int(0.99 * len(xs)))], "max_ms": 1e3 * xs[-1], "n": len(xs)}


def summary(arm: Arm, n_servers: int) -> dict:
    tokens = len(arm.latencies_s) + len(arm.long_latencies_s)
    procs = {"client": {**arm.client_gc, "frozen_objects": arm.client_frozen}}
    procs.update({f"server{i}": g for i, g in enumerate(arm.server_gc)})
    for p in procs.values():
        p["gc_us_per_token"] = 1e6 * sum(p["seconds"]) / tokens
        p["per_1k_tokens"] = [1e3 * x / tokens for x in p["collections"]]
    row = {"arm": arm.name, "servers": n_servers, "all": latency(arm.latencies_s + arm.long_latencies_s),
           "gc": procs, "load": os.getloadavg(), "session_medians_ms": [1e3 * x for x in arm.session_medians_s],
           "full_collection_at_long_end_ms": None if arm.full_collection_s is None else 1e3 * arm.full_collection_s}
    if arm.latencies_s:
        row["short"] = latency(arm.latencies_s)
    if arm.long_latencies_s:
        row["long"] = latency(arm.long_latencies_s)
    return row


@contextlib.contextmanager
def arms_for(n_servers: int, log_dir: Path, push: str, max_length: int):
    from swarmlm.model.checkpoint import load_config
    from swarmlm.swarm.lifetime import popen_dying_with_us
    from swarmlm.swarm.local import LocalSwarm, even_split
    from swarmlm.types import BlockRange

    blocks = int(load_config(MODEL).num_hidden_layers)
    ranges = even_split(blocks, n_servers) if n_servers > 1 else [BlockRange(0, blocks)]
    with contextlib.ExitStack() as stack:
        arms = []
        for name in ARMS:
            swarm = stack.enter_context(LocalSwarm(MODEL, threads=1, with_dht=False, log_dir=log_dir / f"{name}{n_servers}",
                                                   server_args=["--quant", "auto", "--publish-counters",
                                                                "--max-length", str(max_length), "--cache-mb", "1024"]))
            wrap = [sys.executable, __file__, "--child", "unfrozen"] if name == "unfrozen" else []
            servers = [swarm.start_server(r, wait=False, prefix=wrap) for r in ranges]
            swarm.wait_ready(servers)
            client = popen_dying_with_us(
                [sys.executable, __file__, "--client", name, push, *swarm.addresses], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=open(log_dir / f"client-{name}{n_servers}.err", "w"), text=True,
                env=dict(os.environ, OMP_NUM_THREADS="1"))
            stack.callback(stop_client, client)
            arm = Arm(name, swarm, client)
            ready = json.loads(client.stdout.readline() or "{}")
            if not ready.get("ready"):
                raise RuntimeError(f"the {name} client did not start; see {log_dir}")
            arm.client_frozen = ready["frozen_objects"]
            arms.append(arm)
        yield arms


def stop_client(client: subprocess.Popen) -> None:
    if client.stdin:
        client.stdin.close()  # (its command loop ends: it closes its sessions and exits)
    try:
        client.wait(30)
    except subprocess.TimeoutExpired:
        client.kill()


def signal_census(server, base: str, n: int) -> dict:
    """The `n`th census of an unfrozen server (its pid is the process LocalSwarm started: the wrapper execs
    nothing)."""
    server.proc.send_signal(signal.SIGUSR1)
    path = Path(f"{base}-{server.proc.pid}.{n}")
    deadline = time.monotonic() + 60
    while not path.is_file():
        if time.monotonic() > deadline:
            raise RuntimeError(f"server {server.proc.pid} wrote no census {path}")
        time.sleep(0.05)
    return json.loads(path.read_text())


def census(arm: Arm, tokens: int, base: str) -> dict:
    """The client's census of a session of `tokens` steps, and each server's over the same session (read while it
    runs: before its first step and after its last, the session open)."""
    servers = arm.swarm.servers
    before = [signal_census(s, base, 0) for s in servers]  # (the client's session has not opened yet)
    arm.client.stdin.write(json.dumps({"census": tokens}) + "\n")
    arm.client.stdin.flush()
    assert json.loads(arm.client.stdout.readline()) == {"steps_done": True}
    after = [signal_census(s, base, 1) for s in servers]  # (the session still open: the client waits for a line)
    arm.client.stdin.write("\n")
    arm.client.stdin.flush()
    out = json.loads(arm.client.stdout.readline())
    result = {"client": out["census"]}
    result.update({f"server{i}": per_token(a, b, tokens) for i, (a, b) in enumerate(zip(after, before))})
    return result


def table(rows: list[dict]) -> str:
    lines = ["| servers | arm | tokens | mean ms | median ms | p99 ms | max ms | long session: mean / max ms | full GC at "
             "its end ms | process | gen0/1/2 per 1k tokens | longest gen2 ms | GC us/token |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a = r["all"]
        long = f"{r['long']['mean_ms']:.2f} / {r['long']['max_ms']:.1f}" if "long" in r else "-"
        full = r["full_collection_at_long_end_ms"]
        long += f" | {full:.1f}" if full is not None else " | -"
        for i, (proc, g) in enumerate(r["gc"].items()):
            head = (f"| {r['servers']} | {r['arm']} | {a['n']} | {a['mean_ms']:.2f} | {a['median_ms']:.2f} | "
                    f"{a['p99_ms']:.2f} | {a['max_ms']:.1f} | {long} ") if i == 0 else "| | | | | | | | | "
            per_k = "/".join(f"{x:.1f}" for x in g["per_1k_tokens"])
            lines.append(f"{head}| {proc} | {per_k} | {1e3 * g['longest_s'][2]:.1f} | {g['gc_us_per_token']:.1f} |")
    return "\n".join(lines)


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        return unfrozen(sys.argv[3:])
    if sys.argv[1:2] == ["--client"]:
        return client_child(sys.argv[2], sys.argv[3], sys.argv[4:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", type=int, nargs="+", default=[1, 3])
    p.add_argument("--sessions", type=int, default=5, help="short sessions per arm")
    p.add_argument("--tokens", type=int, default=200, help="decode steps per short session")
    p.add_argument("--long", type=int, default=3000, help="decode steps of the long session (0: none)")
    p.add_argument("--census", type=int, default=0, metavar="TOKENS",
                   help="then count the objects a session of this many steps adds (unfrozen arm, not timed)")
    p.add_argument("--push", choices=["off", "on", "auto"], default="off",
                   help="the clients' ClientConfig.push: fixed by default, so both arms take the same path (auto "
                        "decides per swarm from measured speeds and RTTs, and one arm pushing while the other relays "
                        "moved the medians by 2 ms)")
    args = p.parse_args()

    from swarmlm.machine import machine_line

    log_dir = Path(tempfile.mkdtemp(prefix="gc-pauses-"))
    print(machine_line(), "| load at start", os.getloadavg(), "| logs", log_dir, file=sys.stderr)
    rows = []
    for n in args.servers:
        base = str(log_dir / f"census{n}")
        os.environ["GC_PAUSES_CENSUS"] = base  # (the unfrozen servers inherit it)
        longest = len(PROMPT) + max(args.tokens, args.long, args.census) + 1
        with arms_for(n, log_dir, args.push, max(longest, 2048)) as arms:
            plan = [args.tokens] * args.sessions + ([args.long] if args.long else [])
            for i, tokens in enumerate(plan):
                for arm in (arms if i % 2 == 0 else arms[::-1]):  # (which goes first alternates too)
                    lat = arm.session(tokens, probe=tokens == args.long and i == len(plan) - 1)
                    (arm.long_latencies_s if tokens == args.long and i == len(plan) - 1 else arm.latencies_s).extend(lat)
            for arm in arms:
                row = summary(arm, n)
                rows.append(row)
                print(json.dumps(row), flush=True)
            # sessions run side by side share the machine's load of their moment: the median of their differences
            pairs = [1e3 * (f - u) for f, u in zip(arms[0].session_medians_s, arms[1].session_medians_s)]
            print(json.dumps({"servers": n, "paired_median_difference_ms": statistics.median(pairs),
                              "of": f"{ARMS[0]} - {ARMS[1]}", "pairs_ms": pairs}), flush=True)
            if args.census:
                print(json.dumps({"census": census(arms[ARMS.index("unfrozen")], args.census, base), "servers": n,
                                  "tokens": args.census}), flush=True)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
