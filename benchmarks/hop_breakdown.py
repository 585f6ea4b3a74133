"""Where a decode step's time goes through N tiny-bloom servers on loopback (medians of 400 steps, no LM head):

    the caller's session.step = server compute + server queue + server parse/serialise + wire and gRPC
                                + client serialise/parse + the client's own work (between hops, hand-off to its loop)

Usage: .venv/bin/python benchmarks/hop_breakdown.py [--servers N] [--preset tiny-bloom] [--ab ROUNDS --base REV]

--local: also the same blocks in this process (a Stage: what a swarm of one process would compute), and the
client's embeddings and LM head per token, in rounds alternating with the swarm's: where a BLOOMZ token's time
goes, swarm vs one process (`--preset bloomz-560m --servers 1 --local`).

--head-between: rounds alternating with and without the client's LM head between steps (a real token computes it
there): what a long burst of compute between messages adds to each part (with --transports: the head between
every step of both clients).

--transports: rounds alternating between a client on gRPC's Inference streams and one on the framed step port
(wire/frames.py), against the same servers: the per-hop overhead (step minus server compute, over the servers)
of each, side by side (docs/RESULTS-hop.md), and the CPU time per step of the client and the servers together (it
hardly grows with the machine's load, unlike wall time: the transports' work per message). --push on|off|auto: the
clients' push setting.

--llamacpp BUILD/bin (with the default mode or --transports): after swarmlm's rounds, the same preset's checkpoint
as a float32 GGUF (llama.cpp's converter, once, into the checkpoint's directory) through llama.cpp locally and over
1..N `ggml-rpc-server`s (benchmarks/llamacpp_hop.py), its per hop beside swarmlm's in one table.

--server-ab FLAG: two swarms of this tree, servers started with --FLAG and --no-FLAG (a boolean server option:
step-lane, one-call-steps, push-frames), their framed clients alternating: the option's effect side by side.

--ab: this tree against git revision REV (exported with `git archive`, client and servers both), rounds alternating
in one run, each round a fresh swarm (medians, and the median of per-round ratios of the caller's step); with
--frames, both on the framed step port.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.machine import machine_line
from swarmlm.model.checkpoint import load_config
from swarmlm.model.random_checkpoint import default_checkpoint
from swarmlm.swarm.local import LocalSwarm, even_split

from source_tree import source_tree  # (benchmarks/: this script's directory)

PROMPT = list(range(10, 26))


def cpu_s(pids: list[int]) -> float:
    """CPU seconds used so far by this process (every thread) and the processes `pids` (user + system)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = time.process_time()
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return total


def breakdown(client: DistributedModelForCausalLM, sessions: int = 4, steps: int = 100,
              head_between: bool = False, pids: list[int] = ()) -> dict[str, float]:
    """Median milliseconds per decode step, per part. `head_between`: the client computes its LM head on each
    step's output before the next step, as every generated token does (a long burst of compute between messages).
    `pids`: the servers' processes; then also the CPU time per step of the client and the servers together (the
    mean over the steps, compute included: unlike wall time it hardly grows with the machine's load, so two
    transports' difference in it is their difference in work per message)."""
    rows: list[dict[str, float]] = []
    cpu = 0.0
    for _ in range(sessions):
        with client.inference_session(max_length=len(PROMPT) + steps + 1) as session:
            client.step_logits(session, torch.tensor([PROMPT]))
            x = client.embed(torch.tensor([[5]]))
            cpu -= cpu_s(pids)
            for _ in range(steps):
                t0 = time.perf_counter()
                out = session.step(x)
                call = time.perf_counter() - t0
                if head_between:
                    client.head(out)
                rec = session.steps[-1]
                hops = rec.hops
                wall, queued = sum(h.wall_s for h in hops), sum(h.queued_s for h in hops)
                compute, sio = sum(h.compute_s for h in hops), sum(h.server_io_s for h in hops)
                cio = sum(h.client_io_s for h in hops)
                if rec.pushed:  # one chain out and back: its hops' walls overlap, the step's own wall is the chain's
                    wall = rec.wall_s - cio
                rows.append({
                    "step - server compute": call - compute,
                    "the caller's session.step": call,
                    "server compute (all hops)": compute,
                    "wire + gRPC": wall - queued - compute - sio,
                    "server parse/validate + serialise": sio,
                    "server queue": queued,
                    "client serialise + parse": cio,
                    "client: between hops + hand-off": (rec.wall_s - wall - cio) + (call - rec.wall_s),
                })
            cpu += cpu_s(pids)
    parts = {k: statistics.median(r[k] for r in rows) * 1000 for k in rows[0]}
    if pids:
        parts["CPU per step (client + servers)"] = cpu / len(rows) * 1000
    return parts


def local_parts(client: DistributedModelForCausalLM, stage, steps: int = 50) -> dict[str, float]:
    """Median milliseconds per decode token: the same blocks in this process, and the client's embed and head."""
    from swarmlm.types import BlockRange

    blocks = BlockRange(0, stage.blocks.end)
    state = stage.new_state(blocks, 1, len(PROMPT) + steps + 1)
    stage.step(state, client.embed(torch.tensor([PROMPT])), torch.ones(1, len(PROMPT), dtype=torch.long))
    one, rows = torch.ones(1, 1, dtype=torch.long), []
    for _ in range(steps):
        t0 = time.perf_counter()
        x = client.embed(torch.tensor([[5]]))
        t1 = time.perf_counter()
        out = stage.step(state, x, one)
        t2 = time.perf_counter()
        client.head(out)
        t3 = time.perf_counter()
        rows.append({"local: the same blocks in-process": t2 - t1, "client embed": t1 - t0, "client LM head": t3 - t2})
    return {k: statistics.median(r[k] for r in rows) * 1000 for k in rows[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--preset", default="tiny-bloom")
    ap.add_argument("--transports", action="store_true", help="gRPC vs framed steps, rounds alternating")
    ap.add_argument("--push-ab", action="store_true", help="relayed vs pushed steps (framed), rounds alternating")
    ap.add_argument("--push", choices=("auto", "on", "off"), default="auto", help="the client's push setting")
    ap.add_argument("--ab", type=int, default=0, metavar="ROUNDS", help="this tree vs --base, alternating")
    ap.add_argument("--server-ab", metavar="FLAG", help="two swarms of this tree, servers started with --FLAG and "
                    "--no-FLAG (a boolean server option, e.g. step-lane), their framed clients alternating")
    ap.add_argument("--base", default="HEAD", help="git revision to compare with (--ab)")
    ap.add_argument("--frames", action="store_true", help="the client on the framed step port (with --ab, --json)")
    ap.add_argument("--push-frames", action=argparse.BooleanOptionalAction, default=None,
                    help="the servers push on the next server's framed port, or on gRPC (default: the servers' "
                         "default; --push-ab: on)")
    ap.add_argument("--json", action="store_true", help="one round (warm-up + 1 session), as JSON")
    ap.add_argument("--local", action="store_true", help="also the same blocks in this process + the client's head")
    ap.add_argument("--rounds", type=int, default=4, help="sessions of 100 steps (with --local: alternating)")
    ap.add_argument("--head-between", action="store_true",
                    help="the client's LM head between steps, as in generation (without --local: rounds alternate "
                         "with and without it)")
    ap.add_argument("--llamacpp", type=Path, metavar="BUILD/bin",
                    help="also llama.cpp's RPC backend per hop at the same shapes (default mode or --transports)")
    ap.add_argument("--converter", type=Path, help="llama.cpp's convert_hf_to_gguf.py (default: beside --llamacpp)")
    args = ap.parse_args()
    if args.llamacpp and (args.ab or args.push_ab or args.json or args.local or args.head_between):
        ap.error("--llamacpp goes with the default mode or --transports only")
    print("machine:", machine_line(), flush=True)  # where the figures below come from
    if args.ab:
        return compare(args)
    torch.set_num_threads(1)
    if args.server_ab:
        return server_ab(args)
    swarm_hops = run_swarm(args)
    if args.llamacpp is not None:
        beside_llamacpp(args, swarm_hops)


def run_swarm(args: argparse.Namespace) -> dict[str, float]:
    """The swarm's rounds as the mode asks, printed; the per-hop overhead (ms) of the default mode and of each
    --transports client (empty for the other modes)."""
    model_dir = str(default_checkpoint(args.preset))
    push_frames = True if args.push_ab else args.push_frames
    server_args = [] if push_frames is None else ["--push-frames" if push_frames else "--no-push-frames"]
    with LocalSwarm(model_dir, threads=1, with_dht=False, server_args=server_args) as swarm:
        swarm.start(even_split(int(load_config(model_dir).num_hidden_layers), args.servers))
        pids = [s.proc.pid for s in swarm.servers]
        push = {"auto": "auto", "on": True, "off": False}[args.push]
        client = DistributedModelForCausalLM.from_pretrained(model_dir, servers=swarm.addresses, push=push,
                                                             **({"frames": True} if args.frames else {}))
        if args.transports:
            grpc_client = DistributedModelForCausalLM.from_pretrained(model_dir, servers=swarm.addresses, push=push,
                                                                      frames=False)
            client = DistributedModelForCausalLM.from_pretrained(model_dir, servers=swarm.addresses, push=push,
                                                                 frames=True)
            per_hop = alternating({"gRPC": grpc_client, "framed": client}, args.rounds, args.servers,
                                  args.head_between, pids)
            assert client.remote.channels.frame_ports and not grpc_client.remote.channels.frame_ports
            return {f"swarmlm {name}": ms for name, ms in per_hop.items()}
        if args.push_ab:
            relayed = DistributedModelForCausalLM.from_pretrained(model_dir, servers=swarm.addresses, push=False,
                                                                  frames=True)
            pushed = DistributedModelForCausalLM.from_pretrained(model_dir, servers=swarm.addresses, push=True,
                                                                 frames=True)
            alternating({"relayed": relayed, "pushed": pushed}, args.rounds, args.servers, pids=pids)
            return {}
        if args.json:
            breakdown(client, 1, 20)  # warm-up
            print(json.dumps(breakdown(client, 1, 100)))
            return {}
        if not args.local and args.head_between:
            runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
            for r in range(args.rounds):  # alternating: machine noise hits both alike
                for head in ((False, True) if r % 2 == 0 else (True, False)):
                    runs[head].append(breakdown(client, 1, 50, head_between=head))
            print(f"{'part':36s} {'no head':>9s} {'head between steps':>20s}")
            for part in runs[False][0]:
                a, b = (statistics.median(run[part] for run in runs[h]) for h in (False, True))
                print(f"{part:36s} {a:9.3f} {b:20.3f} ms")
            return {}
        if not args.local:
            parts = breakdown(client, args.rounds)
            for part, ms in parts.items():
                print(f"{part:36s} {ms:7.3f} ms")
            return {"swarmlm": parts["step - server compute"] / args.servers}
        from swarmlm.server.stage import Stage
        from swarmlm.types import BlockRange

        stage = Stage(model_dir, BlockRange(0, int(load_config(model_dir).num_hidden_layers)))
        rounds = []
        for _ in range(args.rounds):  # alternating: machine noise hits both alike
            rounds.append({**breakdown(client, 1, 50), **local_parts(client, stage, 50)})
        med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        for part, ms in med.items():
            print(f"{part:36s} {ms:7.3f} ms")
        swarm = med["the caller's session.step"] + med["client embed"] + med["client LM head"]
        local = med["local: the same blocks in-process"] + med["client embed"] + med["client LM head"]
        print(f"{'token through the swarm (embed+step+head)':36s} {swarm:7.3f} ms")
        print(f"{'token in one process (embed+blocks+head)':36s} {local:7.3f} ms   swarm/local {swarm / local:.3f}x")
        return {}


def server_ab(args: argparse.Namespace) -> None:
    """A boolean server option on and off: two swarms of this tree (servers started with --FLAG, and with --no-FLAG),
    their framed clients alternating round by round: each one's parts and per-hop overhead side by side."""
    model_dir = str(default_checkpoint(args.preset))
    ranges = even_split(int(load_config(model_dir).num_hidden_layers), args.servers)
    push = {"auto": "auto", "on": True, "off": False}[args.push]
    with contextlib.ExitStack() as stack:
        clients, pids = {}, []
        for flag in (f"--{args.server_ab}", f"--no-{args.server_ab}"):
            swarm = stack.enter_context(LocalSwarm(model_dir, threads=1, with_dht=False, server_args=[flag]))
            swarm.start(ranges)
            pids += [s.proc.pid for s in swarm.servers]  # (the idle swarm's CPU: ~0 while the other one steps)
            clients[flag] = DistributedModelForCausalLM.from_pretrained(model_dir, servers=swarm.addresses,
                                                                        push=push, frames=True)
        alternating(clients, args.rounds, args.servers, args.head_between, pids)


def beside_llamacpp(args: argparse.Namespace, swarm_hops: dict[str, float]) -> None:
    """The preset's GGUF through llama.cpp locally and over 1..N RPC servers (rounds alternating), its per hop in
    one table with swarmlm's per hop at N servers (both: what a server costs a token besides its blocks' compute)."""
    from llamacpp_hop import converter_of, gguf_f32, per_hop, table_rows

    model_dir = default_checkpoint(args.preset)
    gguf = gguf_f32(Path(model_dir), args.converter or converter_of(args.llamacpp))
    print("llama.cpp: load average (1, 5, 15 min) at start: %.2f %.2f %.2f" % os.getloadavg(), flush=True)
    result = per_hop(args.llamacpp, gguf, int(load_config(str(model_dir)).num_hidden_layers), args.servers,
                     args.rounds, tokens=64)
    print("llama.cpp: load average (1, 5, 15 min) at end: %.2f %.2f %.2f" % os.getloadavg())
    print(f"\nper hop, ms ({args.preset}; llama.cpp: llama-bench tg 64 tokens, -t 1, -lm none, blocks on the RPC servers, "
          f"medians of {args.rounds} rounds; swarmlm: (step - server compute) / {args.servers} servers)")
    rows = table_rows(result)
    print(rows[0] + "".join(f" {name:>15s}" for name in swarm_hops))
    for name, row in zip(result, rows[1:]):
        at_n = name == f"{args.servers} rpc"
        print(row + "".join(f" {(f'{ms:.3f}' if at_n else ''):>15s}" for ms in swarm_hops.values()))


def alternating(clients: dict[str, DistributedModelForCausalLM], rounds: int, servers: int,
                head_between: bool = False, pids: list[int] = ()) -> dict[str, float]:
    """Rounds of 100 steps alternating between the clients (machine noise hits them alike): medians side by side,
    and the per-hop overhead: the median over rounds of (step - server compute) / servers, ms, returned per client.
    `head_between`: the LM head between steps, as a generated token computes it."""
    for client in clients.values():
        breakdown(client, 1, 20)  # warm-up (connections, caches)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in clients}
    print("load average (1, 5, 15 min) at start: %.2f %.2f %.2f" % os.getloadavg(), flush=True)
    for r in range(rounds):
        for name in (list(clients) if r % 2 == 0 else list(clients)[::-1]):
            runs[name].append(breakdown(clients[name], 1, 100, head_between, pids))
    names = list(clients)
    print(f"{'part (medians of ' + str(rounds) + ' rounds, ms)':42s} " + " ".join(f"{n:>8s}" for n in names))
    med = {name: {k: statistics.median(run[k] for run in runs[name]) for k in runs[name][0]} for name in names}
    for part in med[names[0]]:
        print(f"{part:42s} " + " ".join(f"{med[n][part]:8.3f}" for n in names))
    per_hop = {n: statistics.median(run["step - server compute"] for run in runs[n]) / servers for n in names}
    print(f"{'per-hop overhead (step - compute) / ' + str(servers):42s} " + " ".join(f"{per_hop[n]:8.3f}" for n in names))
    print("load average (1, 5, 15 min) at end: %.2f %.2f %.2f" % os.getloadavg(), flush=True)
    return per_hop


def compare(args: argparse.Namespace) -> None:
    """Rounds alternating between this tree and the base revision, each a subprocess with its own swarm."""
    repo = Path(__file__).resolve().parent.parent
    with source_tree(args.base) as base:
        print("load average (1, 5, 15 min) at start: %.2f %.2f %.2f" % os.getloadavg(), flush=True)
        trees = {"this tree": str(repo), args.base: base}
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for r in range(args.ab):
            for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                env = dict(os.environ, PYTHONPATH=trees[name])
                out = subprocess.run([sys.executable, __file__, "--json", "--servers", str(args.servers), "--preset",
                                      args.preset, "--push", args.push, *(["--frames"] if args.frames else [])],
                                     env=env, cwd=trees[name], check=True, capture_output=True,
                                     text=True).stdout
                runs[name].append(json.loads(out.strip().splitlines()[-1]))
    new, old = runs["this tree"], runs[args.base]
    for part in new[0]:
        a, b = statistics.median(run[part] for run in new), statistics.median(run[part] for run in old)
        print(f"{part:36s} this tree {a:7.3f} ms   {args.base} {b:7.3f} ms")
    key = "the caller's session.step"
    ratio = statistics.median(a[key] / b[key] for a, b in zip(new, old))
    print(f"per-round ratio of the step, this tree / {args.base}: {ratio:.3f}")
    print("load average (1, 5, 15 min) at end: %.2f %.2f %.2f" % os.getloadavg(), flush=True)


if __name__ == "__main__":
    main()
