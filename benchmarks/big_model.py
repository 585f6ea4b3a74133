"""A model no process here holds whole, served by 4 servers under memory caps, checked against the bounded-memory
reference (issue 35).

    python benchmarks/big_model.py                       # llama-8b Q4_0 (written once, ~4.5 GB, cached)
    python benchmarks/big_model.py --preset tiny-llama   # the same path in seconds

1. The preset's GGUF is written once (model/gguf_writer.py) to ~/.cache/swarmlm/gguf/<preset>-seed<S>.<type>.gguf.
2. The bounded-memory reference (model/reference.py: one dequantized block at a time) computes 2 prompts x 8 greedy
   steps in a child process (its peak RSS reported: the one-block bound); its result is cached beside the file.
3. 4 servers start, each with `--memory-mb` and, where the machine has the cgroup v1 memory controller and we may
   write it, in its own cgroup with memory.limit_in_bytes = budget + --runtime-mb (Python, torch, gRPC, DHT), made
   before and removed after. Their peak RSS (VmHWM, the file's pages they touched included), peak anonymous RSS
   (sampled) and the cgroups' peak usage (page cache charged included) are reported beside the budget.
4. A client (packed embeddings and head) runs the same 2 prompts x 8 greedy steps in one session: each step's
   logits within --rtol relative (L2) of the reference and the same tokens; decode tokens/s; the client's peak RSS.
Results: printed, and JSON to --out.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

CACHE = Path.home() / ".cache" / "swarmlm" / "gguf"
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
PROMPTS = [[1, 450, 1301, 2183, 77, 912, 35, 3002, 318, 94, 1200, 61],  # token ids, equal lengths: one batch
           [1, 3999, 12, 845, 2048, 7, 1500, 300, 41, 2701, 88, 1023]]
MIB = 1 << 20
BASE_PORT = 40300  # servers on emulated hosts (--network) listen on fixed ports, each host its own address


def model_file(preset: str, gguf_type: str, seed: int) -> Path:
    from swarmlm.model.random_checkpoint import init_gguf

    path = CACHE / f"{preset}-seed{seed}.{gguf_type}.gguf"
    if not path.is_file():  # written under a temporary name and renamed: a present file is complete
        t0 = time.perf_counter()
        init_gguf(preset, path, gguf_type, seed)
        print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.0f} s")
    return path


def prompts_for(vocab: int) -> list[list[int]]:
    return [[t % vocab for t in p] for p in PROMPTS]


def reference(path: Path, steps: int) -> dict:
    """The reference's tokens and logits, computed in a child process once per file and step count."""
    cached = path.with_name(f"{path.name}.reference-{steps}.pt")
    if not cached.is_file():
        t0 = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--reference-of", str(path), "--steps", str(steps),
                        "--reference-out", str(cached)], check=True)
        print(f"reference computed in {time.perf_counter() - t0:.0f} s")
    return torch.load(cached, weights_only=True)  # tensors and numbers only (no pickle of objects)


def run_reference(path: Path, steps: int, out: Path) -> None:
    from swarmlm.model.reference import BoundedReference

    peaks = AnonPeaks()
    peaks.pids.append(os.getpid())
    ref = BoundedReference(str(path))
    t0 = time.perf_counter()
    result = ref.greedy(prompts_for(int(ref.config.vocab_size)), steps)
    seconds = time.perf_counter() - t0
    torch.save({"tokens": result.tokens, "logits": result.logits, "seconds": seconds,
                "peak_rss_bytes": _peak_rss(os.getpid()), "peak_anon_bytes": peaks.stop()[os.getpid()],
                "largest_block_bytes": ref.largest_block_bytes},
               out.with_suffix(".tmp"))
    os.replace(out.with_suffix(".tmp"), out)


def _status(pid: int, field: str) -> int:
    """A memory line of /proc/PID/status, in bytes (0 once the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _peak_rss(pid: int) -> int:
    """VmHWM: the process's peak resident set, file pages it touched included (a mapped GGUF's pages count)."""
    return _status(pid, "VmHWM")


class AnonPeaks:
    """Peak anonymous resident memory (RssAnon: the process's own, not the file's cached pages) of some processes,
    sampled every `period_s` by a thread."""

    def __init__(self, period_s: float = 0.2) -> None:
        import threading

        self.pids: list[int] = []
        self.peaks: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True)
        self._thread.start()

    def _run(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            for pid in list(self.pids):
                self.peaks[pid] = max(self.peaks.get(pid, 0), _status(pid, "RssAnon"))

    def stop(self) -> dict[int, int]:
        self._stop.set()
        self._thread.join()
        return self.peaks


class MemoryCgroup:
    """A cgroup v1 memory group with a hard limit; a process joins it at start (`prefix`), removed on close."""

    def __init__(self, name: str, limit_bytes: int) -> None:
        self.path = CGROUP_ROOT / name
        self.path.mkdir()
        (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        self.limit_bytes = limit_bytes

    @staticmethod
    def available() -> bool:
        return (CGROUP_ROOT / "memory.limit_in_bytes").is_file() and os.access(CGROUP_ROOT, os.W_OK)

    @property
    def prefix(self) -> list[str]:
        """The command's prefix: the shell writes its own pid into the group, then becomes the server."""
        return ["sh", "-c", f'echo $$ > {self.path / "cgroup.procs"} && exec "$@"', "sh"]

    def peak_bytes(self) -> int:
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    def failures(self) -> int:
        return int((self.path / "memory.failcnt").read_text())

    def close(self, timeout_s: float = 30.0) -> None:
        """Remove the group once its processes are gone (a killed server's children exit a moment later)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.path.rmdir()
                return
            except OSError as exc:
                if time.monotonic() > deadline:
                    print(f"could not remove {self.path}: {exc}", file=sys.stderr)
                    return
                time.sleep(0.2)


def swarm_greedy(client, prompts: list[list[int]], steps: int,
                 kill_at: int | None = None, kill=None) -> tuple[torch.Tensor, torch.Tensor, float, list[float]]:
    """tokens [B, steps], logits [steps, B, V], decode seconds (steps after the first), each step's seconds;
    `kill()` is called before step `kill_at`."""
    ids = torch.tensor(prompts)
    tokens, logits, step_s = [], [], []
    with client.inference_session(max_length=ids.shape[1] + steps + 1, batch_size=ids.shape[0]) as session:
        last = client.step_logits(session, ids, last_only=True)[:, -1].float()
        t0 = time.perf_counter()
        for step in range(steps):
            t = time.perf_counter()
            if step == kill_at:
                kill()
            if step:
                last = client.step_logits(session, tokens[-1], last_only=True)[:, -1].float()
            logits.append(last)
            tokens.append(last.argmax(-1, keepdim=True))
            step_s.append(time.perf_counter() - t)
        decode_s = time.perf_counter() - t0
    return torch.cat(tokens, 1), torch.stack(logits), decode_s, step_s


def run(args: argparse.Namespace) -> dict:
    from swarmlm.client.model import DistributedModelForCausalLM
    from swarmlm.machine import machine_info
    from swarmlm.model.checkpoint import load_config
    from swarmlm.bench.netem import Testbed, network_for
    from swarmlm.swarm.local import LocalSwarm, even_split, read_event

    path = model_file(args.preset, args.gguf, args.seed)
    ref = reference(path, args.steps)
    config = load_config(str(path))
    prompts = prompts_for(int(config.vocab_size))
    ranges = even_split(int(config.num_hidden_layers), args.servers)
    caps = MemoryCgroup.available() and not args.no_cgroup
    server_args = ["--memory-mb", str(args.memory_mb), "--cache-mb", str(args.cache_mb), "--dtype", "float32",
                   "--quant", "auto", "--rebalance-period", "0"]
    if args.open_idle_timeout is not None:
        server_args += ["--open-idle-timeout", str(args.open_idle_timeout)]
    swarm = LocalSwarm(str(path), threads=args.threads, server_args=server_args, start_timeout_s=1800,
                       with_dht=args.network == "loopback")
    groups: list[MemoryCgroup | None] = []
    peaks = AnonPeaks()
    peaks.pids.append(os.getpid())
    with contextlib.ExitStack() as stack:
        testbed = stack.enter_context(Testbed(len(ranges), network_for(args.network, len(ranges)))) \
            if args.network != "loopback" else None
        stack.callback(lambda: [g.close() for g in groups if g is not None])  # (after the servers stopped: LIFO)
        stack.callback(swarm.stop)
        if testbed is None:
            swarm.start_dht()

        def start(i: int, blocks, extra: list[str] = (), where: dict | None = None):
            group = MemoryCgroup(f"swarmlm-big-{os.getpid()}-{i}", (args.memory_mb + args.runtime_mb) * MIB) \
                if caps else None
            groups.append(group)
            prefix = (group.prefix if group else []) + (testbed.exec_prefix(i) if testbed is not None else [])
            server = swarm.start_server(blocks, wait=False, prefix=prefix, extra=list(extra), **(where or {}))
            peaks.pids.append(server.proc.pid)
            return server

        started = [start(i, blocks, *(() if testbed is None else (
            ["--port", str(BASE_PORT + i)], {"host": testbed.host_ip(i)}))) for i, blocks in enumerate(ranges)]
        swarm.wait_ready(started)
        failover: dict = {}
        if args.failover:  # a spare placed by its budget (no --blocks): it takes a window already served
            spare = start(len(ranges), None, ["--rebalance-period", "600"])  # only blocks left uncovered move it
            swarm.wait_ready([spare])
            held = range(*spare.ready["blocks"])
            victim = next((s for s in started if not set(range(*s.ready["blocks"])) <= set(held)), None)
            if victim is None:
                raise SystemExit(f"the spare holds blocks {held.start}:{held.stop}, every server's: give a smaller "
                                 "--memory-mb")
            failover = {"spare_blocks_at_start": spare.ready["blocks"], "killed_blocks": victim.ready["blocks"],
                        "killed_at_step": args.kill_at}
            # the client's defaults: 30 s for missing blocks, up to 300 s in all once the spare announces them loading
            where = {"initial_peers": swarm.initial_peers}
        elif testbed is None:
            where = {"servers": swarm.addresses}
        else:
            where = {"servers": [testbed.expose(i, BASE_PORT + i) for i in range(len(ranges))]}
        client = DistributedModelForCausalLM.from_pretrained(str(path), **where, routing="shortest",
                                                             dtype="float32", quant="auto")
        try:
            tokens, logits, decode_s, step_s = swarm_greedy(
                client, prompts, args.steps, args.kill_at if args.failover else None,
                lambda: swarm.kill(victim, signal.SIGKILL))
        finally:
            client.close()
        if args.failover:
            failover.update(moved=read_event(spare.proc.stdout, "moved", 60), step_seconds=step_s)
        anon = peaks.stop()
        servers = [{"blocks": s.ready["blocks"], "budget_mb": args.memory_mb, "killed": not s.alive,
                    "peak_rss_mb": _peak_rss(s.proc.pid) / MIB, "peak_anon_rss_mb": anon.get(s.proc.pid, 0) / MIB,
                    **({"cgroup_limit_mb": g.limit_bytes / MIB, "cgroup_peak_mb": g.peak_bytes() / MIB,
                        "cgroup_failcnt": g.failures()} if g is not None else {})}
                   for s, g in zip(swarm.servers, groups)]
        network = {"network": args.network}
        if testbed is not None:
            link = testbed.network.link(-1, 0)
            network.update(netem_mode=testbed.mode, fallback_reason=testbed.fallback_reason,
                           client_link={"rtt_s": link.rtt_s, "rate_bps": link.rate_bps})
    rel = [float((logits[i] - ref["logits"][i]).norm() / ref["logits"][i].norm()) for i in range(args.steps)]
    return {
        "machine": machine_info(), "preset": args.preset, "file": str(path), "file_bytes": path.stat().st_size,
        "servers": servers, **network, "load_average_1_5_15": os.getloadavg(), "threads_per_server": args.threads,
        "memory_caps": "cgroup v1" if caps else "none", **({"failover": failover} if failover else {}),
        "client_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "client_peak_anon_rss_mb": anon.get(os.getpid(), 0) / MIB,
        "prompts": len(prompts), "steps": args.steps,
        "decode_tokens_per_s": len(prompts) * (args.steps - 1) / decode_s,
        "same_tokens_as_reference": bool(torch.equal(tokens, ref["tokens"])),
        "logits_rel_l2_max": max(rel), "logits_within_rtol": max(rel) <= args.rtol,
        "reference": {"seconds": ref["seconds"], "peak_rss_mb": ref["peak_rss_bytes"] / MIB,
                      "peak_anon_rss_mb": ref.get("peak_anon_bytes", 0) / MIB,
                      "largest_block_mb": ref["largest_block_bytes"] / MIB},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-8b")
    parser.add_argument("--gguf", default="q4_0", choices=["q4_0", "q8_0", "f16", "f32"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--memory-mb", type=int, default=2500, help="each server's --memory-mb (weights + cache)")
    parser.add_argument("--cache-mb", type=int, default=256, help="each server's --cache-mb")
    parser.add_argument("--runtime-mb", type=int, default=1024,
                        help="cgroup limit above --memory-mb: the process itself (Python, torch, gRPC, DHT)")
    parser.add_argument("--no-cgroup", action="store_true", help="no memory caps, peak RSS only")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--failover", action="store_true",
                        help="add a spare placed by its --memory-mb (no --blocks); SIGKILL a server it does not "
                             "replicate before step --kill-at: the spare takes its blocks, the same tokens")
    parser.add_argument("--kill-at", type=int, default=3)
    parser.add_argument("--open-idle-timeout", type=float, default=None,
                        help="servers' --open-idle-timeout (default: theirs; a downstream server's limit grows with "
                             "the upstream blocks' measured prefill, ServerConfig.open_idle_limit_s)")
    parser.add_argument("--network", default="loopback",
                        help="loopback, or lan / wan / a topology file: each server on an emulated host (netem testbed)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rtol", type=float, default=1e-2, help="largest relative L2 error of a step's logits")
    parser.add_argument("--out", default="docs/results/big_model.json")
    parser.add_argument("--reference-of", help=argparse.SUPPRESS)  # (the child computing the reference)
    parser.add_argument("--reference-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reference_of:
        run_reference(Path(args.reference_of), args.steps, Path(args.reference_out))
        return 0
    result = run(args)
    print(json.dumps(result, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if result["same_tokens_as_reference"] and result["logits_within_rtol"] else 1


if __name__ == "__main__":
    sys.exit(main())
