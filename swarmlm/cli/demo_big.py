"""`swarmlm demo --preset llama-8b` (or any preset with `--gguf TYPE`): a model no process here holds whole (issue 35).

The preset's random weights are written once as one GGUF file (tensor by tensor, cached), N servers each load their
share within `--memory-mb` (weights as held + `--cache-mb`), one prompt is answered greedily through the swarm, and the
answer is checked against the bounded-memory reference (model/reference.py: one dequantized block at a time, its tokens
cached beside the file). Printed: the route, tokens/s, each server's memory beside its budget, "same tokens as the
reference: yes".
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

MIB = 1 << 20
GGUF_CACHE = Path.home() / ".cache" / "swarmlm" / "gguf"
PROMPT = "The sea is calm today, and the boats"
BIG_NEW_TOKENS = 8  # the reference runs every block once per token (~1 min a token for llama-8b here)


def gguf_file(console, preset: str, gguf_type: str, seed: int = 0) -> Path:
    """~/.cache/swarmlm/gguf/<preset>-seed<S>.<type>.gguf, written once (atomically: a present file is complete)."""
    from swarmlm.model.random_checkpoint import init_gguf

    path = GGUF_CACHE / f"{preset}-seed{seed}.{gguf_type}.gguf"
    if not path.is_file():
        with console.status(f"writing the random {preset} as {gguf_type} to {path} (tensor by tensor, once)"):
            init_gguf(preset, path, gguf_type, seed)
    return path


def weights_mb(path: Path, blocks) -> float:
    """The blocks' weights as a server holds them (packed), from the file's tensor table."""
    from swarmlm.config import ServerConfig
    from swarmlm.server.placement import range_bytes

    return range_bytes(ServerConfig(model_dir=str(path), blocks=None, dtype="float32", quant="auto"), blocks) / MIB


def budget_mb(path: Path, ranges, cache_mb: int) -> int:
    """The largest share's need (weights as held + the cache budget), rounded up to 100 MiB."""
    need = max(weights_mb(path, r) for r in ranges) + cache_mb
    return int(-(-need // 100) * 100)


def _status_mb(pid: int, field: str) -> float:
    """A memory line of /proc/PID/status in MiB (RssAnon: the process's own; VmHWM: its peak, file pages included)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def reference_tokens(console, path: Path, ids: list[int], steps: int) -> list[int]:
    """The bounded-memory reference's greedy tokens, computed once per file, prompt and length (cached beside it)."""
    import hashlib
    import json

    from swarmlm.model.reference import BoundedReference

    key = hashlib.sha256(json.dumps([ids, steps]).encode()).hexdigest()[:16]
    cached = path.with_name(f"{path.name}.demo-{key}.json")
    if cached.is_file():
        return json.loads(cached.read_text())
    with console.status(f"the bounded-memory reference: {steps} tokens, every block loaded, run and freed per token "
                        "(once; cached)"):
        t0 = time.perf_counter()
        ref = BoundedReference(str(path))
        tokens = ref.greedy([ids], steps).tokens[0].tolist()
    console.print(f"reference: {time.perf_counter() - t0:.0f} s, largest block held "
                  f"{ref.largest_block_bytes / MIB:.0f} MiB", soft_wrap=True)
    cached.write_text(json.dumps(tokens))
    return tokens


def run_big(console, args: argparse.Namespace) -> int:
    import torch
    from rich.table import Table

    from swarmlm.client.model import DistributedModelForCausalLM
    from swarmlm.model.checkpoint import load_config, load_tokenizer
    from swarmlm.swarm.local import LocalSwarm, even_split
    from swarmlm.types import describe_spans

    path = gguf_file(console, args.preset, args.gguf or "q4_0")
    ranges = even_split(int(load_config(str(path)).num_hidden_layers), args.servers)
    memory_mb = args.memory_mb or budget_mb(path, ranges, args.cache_mb)
    steps = args.max_new_tokens or BIG_NEW_TOKENS
    ids = load_tokenizer(str(path))(PROMPT).input_ids
    # (a downstream server's first step waits for the upstream ones' prefill: its open-idle limit grows with it,
    # ServerConfig.open_idle_limit_s)
    server_args = ["--memory-mb", str(memory_mb), "--cache-mb", str(args.cache_mb), "--dtype", "float32",
                   "--quant", "auto"]
    swarm = LocalSwarm(str(path), threads=args.threads, server_args=server_args, start_timeout_s=1800)
    try:
        with console.status(f"starting a DHT and {args.servers} servers ({', '.join(map(str, ranges))}), each within "
                            f"--memory-mb {memory_mb}"):
            t0 = time.perf_counter()
            swarm.start(ranges)
        console.print(f"{path.name} ({path.stat().st_size / 2**30:.2f} GiB): swarm ready in "
                      f"{time.perf_counter() - t0:.0f} s", soft_wrap=True)
        model = DistributedModelForCausalLM.from_pretrained(str(path), initial_peers=swarm.initial_peers,
                                                            threads=args.threads, dtype="float32", quant="auto")
        try:
            out = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False)
            stats = model.last_stats
        finally:
            model.close()
        got = out[0, len(ids):].tolist()
        table = Table(title=f"{args.preset}: {args.servers} servers under --memory-mb {memory_mb} "
                            f"(weights as held + --cache-mb {args.cache_mb})")
        for col in ("server", "blocks", "budget MiB", "weights MiB", "own RSS MiB", "peak RSS MiB"):
            table.add_column(col, justify="right", no_wrap=True)
        for s, blocks in zip(swarm.servers, ranges):
            table.add_row(s.server_id[-8:], f"{blocks.start}:{blocks.end}", str(memory_mb),
                          f"{weights_mb(path, blocks):.0f}", f"{_status_mb(s.proc.pid, 'RssAnon'):.0f}",
                          f"{_status_mb(s.proc.pid, 'VmHWM'):.0f}")
        console.print(table)
        console.print("budget: weights as held + the attention cache it may reserve; own RSS: the process's memory "
                      "(RssAnon: weights, caches in use, and Python, torch, gRPC, ~0.3 GB, outside the budget); "
                      "peak RSS: VmHWM, the file's pages it mapped included", soft_wrap=True)
        console.print(f"prompt {ids} -> {got}", soft_wrap=True)
        console.print("route (server id suffix[blocks]): " + describe_spans(stats.route, id_chars=8), soft_wrap=True,
                      markup=False)
        console.print(f"decode: {stats.tokens_per_s:.2f} tokens/s, first token after {stats.ttft_s:.1f} s",
                      soft_wrap=True)
    finally:
        swarm.stop()
    want = reference_tokens(console, path, ids, steps)
    same = got == want[:len(got)]
    console.print(f"same tokens as the reference: {'yes' if same else '[red]NO[/red]'}"
                  + ("" if same else f" (reference {want})"), soft_wrap=True)
    return 0 if same else 1
