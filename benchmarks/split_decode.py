"""Decode through N servers vs through one server of every block, same GGUF (packed weights, --quant auto), beside
llama.cpp's RPC backend splitting the same file over N `ggml-rpc-server`s vs one (issue 40, docs/RESULTS-hop.md).

    python benchmarks/split_decode.py [--model FILE.gguf] [--servers 3] [--rounds 6] [--tokens 64]
                                      [--llamacpp BUILD/bin]

swarmlm: one server holding blocks [0, L) and N servers holding an even split run side by side; two clients, one
routed through each, decode greedily in rounds alternating between them (one torch thread everywhere, loopback,
the client's defaults: transport, push; --transports: gRPC and framed clients, all alternating). Per token = the
median over a round of `step_logits` for one token (embed, every hop, LM head); the ratio is one server's per-token
time over N servers'. llama.cpp: `llama-bench -p 0 -n T -t 1 -ngl 99 --rpc ...` against 1 and N
`ggml-rpc-server -t 1`, alternating too (tokens per second, its own average). --push-frames / --no-push-frames: the
servers push on frames / on gRPC. --push on|off|auto: the N-server client's push setting; --push-ab: three N-server
clients, relayed, pushed (the servers keep the route: protocol 4) and pushed naming the route at every step
(ClientConfig.keep_routes off), alternating with the one-server client. --server-ab FLAG: two sets of servers, started
with --FLAG and --no-FLAG (a boolean server option: one-call-steps, step-lane), all four clients alternating, with
the servers' process CPU per token. --server-base REV: the same with servers of git revision REV and of this tree
(a change to the servers, measured side by side). --relay-ab: each client twice, a relayed decode step's hops in one
C call (client/relay.py) and in Python (ClientConfig.relay_in_c), all alternating.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from pathlib import Path

import torch

from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.machine import machine_line
from swarmlm.model.checkpoint import load_config
from swarmlm.swarm.local import LocalSwarm, even_split
from swarmlm.types import BlockRange

from source_tree import source_tree  # (benchmarks/: this script's directory)

DEFAULT_MODEL = Path.home() / ".cache/swarmlm/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 2]  # any ids: the tokens decoded do not matter


def per_token_ms(client: DistributedModelForCausalLM, tokens: int) -> tuple[float, float, float]:
    """Median ms per greedy token (embed + every hop + LM head) over one session of `tokens` tokens, the median
    of its servers' compute (summed over the hops, as they report it: their forward alone), and the median CPU time
    of the caller's thread per token (a decode step runs its hops there: less at the mercy of the load)."""
    times, computes, cpus = [], [], []
    with client.inference_session(max_length=len(PROMPT) + tokens + 1) as session:
        logits = client.step_logits(session, torch.tensor([PROMPT]), last_only=True)
        for _ in range(tokens):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            c0, t0 = time.thread_time(), time.perf_counter()
            logits = client.step_logits(session, nxt, last_only=True)
            times.append(time.perf_counter() - t0)
            cpus.append(time.thread_time() - c0)
            computes.append(sum(h.compute_s for h in session.steps[-1].hops))
    return statistics.median(times) * 1000, statistics.median(computes) * 1000, statistics.median(cpus) * 1000


def swarmlm_ratio(model: str, servers: int, rounds: int, tokens: int, transports: list[bool | None],
                  server_args: list[str], pushes: dict[str, dict] | None = None,
                  relays: list[bool | None] = (None,)) -> None:
    """`transports`: the clients' ClientConfig.frames (None: the default), `relays`: their ClientConfig.relay_in_c
    (None: the default), each pair a set of clients (1 server, then N servers with each of `pushes`: name -> the
    N-server client's push settings, ClientConfig fields; default: the client's defaults) on the same servers, all
    alternating."""
    pushes = pushes or {"": None}
    blocks = int(load_config(model).num_hidden_layers)
    with LocalSwarm(model, threads=1, with_dht=False, server_args=["--quant", "auto", *server_args]) as swarm:
        swarm.start([BlockRange(0, blocks), *even_split(blocks, servers)])
        one, split = swarm.addresses[:1], swarm.addresses[1:]
        setups = [("1 server", one, None)] + [(f"{servers} servers{' ' + p if p else ''}", split, push)
                                               for p, push in pushes.items()]
        kinds = [(frames, relay) for frames in transports for relay in relays]
        clients = {(kind, name): DistributedModelForCausalLM.from_pretrained(
                       model, servers=addrs, quant="auto", **({} if kind[0] is None else {"frames": kind[0]}),
                       **({} if kind[1] is None else {"relay_in_c": kind[1]}),
                       **(push or {}))
                   for kind in kinds for name, addrs, push in setups}
        for client in clients.values():
            per_token_ms(client, 8)  # warm-up (connections, caches)
        print("load average at start: %.2f %.2f %.2f" % os.getloadavg(), flush=True)
        runs: dict[tuple, list[float]] = {key: [] for key in clients}
        computes: dict[tuple, list[float]] = {key: [] for key in clients}
        cpus: dict[tuple, list[float]] = {key: [] for key in clients}
        for r in range(rounds):
            for key in (list(clients) if r % 2 == 0 else list(clients)[::-1]):
                wall_ms, compute_ms, cpu_ms = per_token_ms(clients[key], tokens)
                runs[key].append(wall_ms)
                computes[key].append(compute_ms)
                cpus[key].append(cpu_ms)
        print("load average at end: %.2f %.2f %.2f" % os.getloadavg())
        for key, values in computes.items():  # (where an extra server's cost goes: its forward, or the hop)
            print(f"  {key[1]} ({_kind_name(key[0])}): servers' compute per token {statistics.median(values):.2f} "
                  f"ms; the rest (hops, client): {statistics.median(runs[key]) - statistics.median(values):.2f} ms; "
                  f"the caller's thread CPU per token {statistics.median(cpus[key]):.3f} ms")
        framed = {kind: bool(clients[kind, "1 server"].remote.channels.frame_ports) for kind in kinds}
    for kind in kinds:
        for name, _, _ in setups[1:]:
            pair = {n: runs[kind, n] for n in ("1 server", name)}
            relay = "" if kind[1] is None else ", hops in C" if kind[1] else ", hops in Python"
            report("swarmlm", pair, f"transport: {'framed' if framed[kind] else 'gRPC'}{relay}")


def _kind_name(kind: tuple[bool | None, bool | None]) -> str:
    frames, relay = kind
    transport = "default" if frames is None else "framed" if frames else "gRPC"
    return transport if relay is None else f"{transport}, hops in {'C' if relay else 'Python'}"


def process_cpu_s(pid: int) -> float:
    """A process's user + system CPU seconds so far (/proc: clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_ab(settings: dict[str, tuple[list[str], str | None]], model: str, servers: int, rounds: int, tokens: int,
              push: str | bool | None) -> None:
    """Two sets of servers (1 of every block, N of an even split), one per setting: name -> (the servers' extra
    options, the source tree they run: None for this one), their four clients (this tree's, framed; `push`: the
    N-server clients' ClientConfig.push, None: the default) alternating in rounds. Per setting: the N / 1 speed ratio,
    and the servers' process CPU per token (all N summed, and the one server), over every round; per setup, the
    second setting's speed over the first's."""
    blocks = int(load_config(model).num_hidden_layers)
    with contextlib.ExitStack() as stack:
        swarms = {}
        for name, (options, tree) in settings.items():
            swarm = stack.enter_context(LocalSwarm(model, threads=1, with_dht=False,
                                                   server_args=["--quant", "auto", *options]))
            with _python_path(tree):  # (the servers' processes take this process's environment when started)
                swarm.start([BlockRange(0, blocks), *even_split(blocks, servers)])
            swarms[name] = swarm
        clients, pids = {}, {}
        for name, swarm in swarms.items():
            for part, addrs, procs in (("1 server", swarm.addresses[:1], swarm.servers[:1]),
                                       (f"{servers} servers", swarm.addresses[1:], swarm.servers[1:])):
                pushing = {} if push is None or part == "1 server" else {"push": push}
                clients[name, part] = stack.enter_context(contextlib.closing(
                    DistributedModelForCausalLM.from_pretrained(model, servers=addrs, quant="auto", **pushing)))
                pids[name, part] = [p.proc.pid for p in procs]
        for client in clients.values():
            per_token_ms(client, 8)  # warm-up (connections, caches)
        print("load average at start: %.2f %.2f %.2f" % os.getloadavg(), flush=True)
        runs = {key: [] for key in clients}
        cpu = {key: 0.0 for key in clients}
        for r in range(rounds):
            for key in (list(clients) if r % 2 == 0 else list(clients)[::-1]):
                before = sum(map(process_cpu_s, pids[key]))
                runs[key].append(per_token_ms(clients[key], tokens)[0])
                cpu[key] += sum(map(process_cpu_s, pids[key])) - before
        print("load average at end: %.2f %.2f %.2f" % os.getloadavg())
    parts = ("1 server", f"{servers} servers")
    for name in settings:
        pair = {part: runs[name, part] for part in parts}
        report("swarmlm", pair, f"servers: {name}")
        per = {part: 1000 * cpu[name, part] / (rounds * (tokens + 1)) for part in pair}
        print(f"  servers' process CPU per token ({name}): " + ", ".join(f"{part} {ms:.3f} ms" for part, ms in
                                                                       per.items()), flush=True)
    for part in parts:
        report(f"swarmlm, {part}", {name: runs[name, part] for name in settings}, "the two settings")


@contextlib.contextmanager
def _python_path(tree: str | None):
    """PYTHONPATH set to `tree` meanwhile (None: left as it is)."""
    if tree is None:
        yield
        return
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = tree
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def llamacpp_ratio(bin_dir: Path, model: str, servers: int, rounds: int, tokens: int) -> None:
    from llamacpp_hop import bench_ms, rpc_servers  # (benchmarks/: this script's directory)

    with rpc_servers(bin_dir, servers + 1) as addresses:
        setups = {"1 server": addresses[:1], f"{servers} servers": addresses[1:]}
        runs: dict[str, list[float]] = {name: [] for name in setups}
        print("load average at start: %.2f %.2f %.2f" % os.getloadavg(), flush=True)
        for r in range(rounds):
            for name in (list(setups) if r % 2 == 0 else list(setups)[::-1]):
                runs[name].append(bench_ms(bin_dir, Path(model), tokens, setups[name], ngl=99, mapped=True))
        print("load average at end: %.2f %.2f %.2f" % os.getloadavg())
    report("llama.cpp RPC", runs, "llama-bench tg, -t 1 -ngl 99")


def report(what: str, runs: dict[str, list[float]], note: str) -> None:
    one, split = (statistics.median(v) for v in runs.values())
    names = list(runs)
    # (each round runs both setups back to back: their ratio within a round is less at the mercy of the load)
    paired = statistics.median(a / b for a, b in zip(*runs.values()))
    print(f"{what} ({note}): per token {names[0]} {one:.2f} ms, {names[1]} {split:.2f} ms; "
          f"{names[1]} / {names[0]} speed {one / split:.3f}x, median of per-round ratios {paired:.3f}x  "
          f"(rounds: {runs})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="a GGUF file")
    ap.add_argument("--servers", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--llamacpp", type=Path, help="llama.cpp's build/bin (ggml-rpc-server, llama-bench)")
    ap.add_argument("--only", choices=("swarmlm", "llamacpp"), help="run one side only")
    ap.add_argument("--transports", action="store_true", help="swarmlm on gRPC and on frames, all alternating")
    ap.add_argument("--push-frames", action=argparse.BooleanOptionalAction, default=None,
                    help="the servers push on frames, or on gRPC (default: the servers' default)")
    ap.add_argument("--push", choices=("auto", "on", "off"), help="the N-server client's push (default: its default)")
    ap.add_argument("--push-ab", action="store_true", help="N servers relayed and pushed, alternating")
    ap.add_argument("--relay-ab", action="store_true",
                    help="every client twice, a relayed step's hops in C and in Python (ClientConfig.relay_in_c), "
                         "alternating")
    ap.add_argument("--server-ab", metavar="FLAG",
                    help="servers started with --FLAG and --no-FLAG (e.g. step-lane, one-call-steps), alternating")
    ap.add_argument("--server-base", metavar="REV",
                    help="servers of git revision REV and of this tree (the clients this tree's), alternating")
    args = ap.parse_args()
    if args.push and args.push_ab:
        ap.error("--push or --push-ab, not both")
    setting = {"auto": "auto", "on": True, "off": False}
    # (--push-ab: a pushed route kept by its servers, the default, and one named again at every step)
    pushes = {"relayed": {"push": False}, "pushed": {"push": True},
              "pushed, route per step": {"push": True, "keep_routes": False}} if args.push_ab else \
        {"": {"push": setting[args.push]}} if args.push else None
    print("machine:", machine_line(), flush=True)
    torch.set_num_threads(1)
    push = setting[args.push] if args.push else None
    if args.server_ab:
        flags = {f"--{args.server_ab}": ([f"--{args.server_ab}"], None),
                 f"--no-{args.server_ab}": ([f"--no-{args.server_ab}"], None)}
        server_ab(flags, args.model, args.servers, args.rounds, args.tokens, push)
    elif args.server_base:
        with source_tree(args.server_base) as base:
            server_ab({args.server_base: ([], base), "this tree": ([], None)}, args.model, args.servers, args.rounds,
                      args.tokens, push)
    elif args.only != "llamacpp":
        swarmlm_ratio(args.model, args.servers, args.rounds, args.tokens,
                      [False, True] if args.transports else [None],
                      [] if args.push_frames is None else ["--push-frames" if args.push_frames else "--no-push-frames"],
                      pushes, [True, False] if args.relay_ab else [None])
    if args.llamacpp is not None and args.only != "swarmlm":
        llamacpp_ratio(args.llamacpp, args.model, args.servers, args.rounds, args.tokens)


if __name__ == "__main__":
    main()
