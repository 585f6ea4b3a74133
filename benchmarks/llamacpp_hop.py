"""What a decode hop costs llama.cpp's RPC backend at a swarmlm checkpoint's shapes (issue 40, docs/RESULTS-hop.md
round 14): the reference next to `hop_breakdown.py`'s per-hop overhead.

    python benchmarks/llamacpp_hop.py --llamacpp BUILD/bin [--preset tiny-bloom] [--servers 3] [--rounds 5]
                                      [--tokens 64] [--head remote]

The preset's random checkpoint (safetensors) is converted once to a float32 GGUF by llama.cpp's own converter
(`convert_hf_to_gguf.py`, two levels above BUILD/bin unless --converter) into `<checkpoint>/model-f32.gguf`, then
reused. `llama-bench -p 0 -n T -t 1 -r 1 -lm none` decodes T tokens in rounds alternating between: local (no RPC device:
every layer on the CPU in this process) and the blocks over 1..N `ggml-rpc-server -t 1` (llama.cpp splits the
layers evenly). Per hop = (ms per token through k servers - ms per token local) / k: what a server costs a token
besides its blocks' compute, as hop_breakdown's (step - server compute) / servers.

--head local (default): `-ngl L` (L = the checkpoint's blocks): the servers hold the blocks only, the embeddings and
the LM head stay in the client, as in swarmlm (a hidden state of `hidden_size` float32 crosses each hop). --head
remote: `-ngl 99`, the LM head on the last server too (its reply is the logits, `vocab_size` float32).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

GGUF_NAME = "model-f32.gguf"  # beside the checkpoint's safetensors, converted once
# Our random checkpoints' tokenizer (a small byte-level BPE made here) is in no table of the converter, which then
# refuses the whole file. llama-bench decodes token ids and never reads token text, so the converter is run with that
# one refusal answered "gpt-2" (the byte-level pre-tokenizer's regex is GPT-2's); everything else is its own code.
_CONVERT = """
import runpy, sys
converter = sys.argv[1]
sys.path.insert(0, converter.rsplit("/", 1)[0])
import conversion.base as base
known = base.TextModel.get_vocab_base_pre
def pre_tokenizer(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
base.TextModel.get_vocab_base_pre = pre_tokenizer
sys.argv = sys.argv[1:]
runpy.run_path(converter, run_name="__main__")
"""


def converter_of(bin_dir: Path) -> Path:
    """llama.cpp's converter in the source tree whose build/bin is `bin_dir`."""
    return bin_dir.resolve().parent.parent / "convert_hf_to_gguf.py"


def gguf_f32(checkpoint: Path, converter: Path) -> Path:
    """`checkpoint` as a float32 GGUF by llama.cpp's converter, made once into the checkpoint's directory (written
    to a temporary name and renamed, so an interrupted conversion leaves nothing to reuse)."""
    if not converter.is_file():
        raise FileNotFoundError(f"llama.cpp's converter {converter} does not exist: give the llama.cpp source tree's "
                                "convert_hf_to_gguf.py (--converter)")
    out = checkpoint / GGUF_NAME
    if out.is_file():
        return out
    partial = out.with_name(GGUF_NAME + ".partial")
    done = subprocess.run([sys.executable, "-c", _CONVERT, str(converter), str(checkpoint), "--outtype", "f32",
                           "--outfile", str(partial)], capture_output=True, text=True)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"converting {checkpoint} to GGUF failed:\n{done.stderr[-2000:]}")
    partial.rename(out)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def rpc_servers(bin_dir: Path, count: int) -> Iterator[list[str]]:
    """`count` ggml-rpc-servers on loopback, one CPU thread each: their addresses."""
    env = dict(os.environ, LD_LIBRARY_PATH=str(bin_dir))
    ports = [free_port() for _ in range(count)]
    procs = [subprocess.Popen([str(bin_dir / "ggml-rpc-server"), "-t", "1", "-p", str(p)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in ports]
    try:
        for port, proc in zip(ports, procs):
            wait_listening(port, proc)
        yield [f"127.0.0.1:{p}" for p in ports]
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


def wait_listening(port: int, proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ggml-rpc-server on port {port} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"ggml-rpc-server on port {port} not listening after {timeout_s} s")


def bench_ms(bin_dir: Path, gguf: Path, tokens: int, rpc: list[str], ngl: int, mapped: bool = False) -> float:
    """ms per generated token of one llama-bench run (`tokens` tokens, one CPU thread), over the RPC servers `rpc`
    (none: local). Unless `mapped`, `-lm none`: every process reads its weights into buffers of its own, as an RPC
    server does with what it is sent; llama.cpp's default maps the file, and a bloomz-560m token then took ~18 ms
    longer in one process here (77.8 vs 59.9 ms, docs/RESULTS-hop.md round 14), which would pass for a negative cost
    per hop."""
    cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", str(tokens), "-r", "1", "-t", "1",
           *([] if mapped else ["-lm", "none"]), "-o", "json",
           *(["-ngl", str(ngl), "-rpc", ",".join(rpc)] if rpc else ["-ngl", "0"])]
    out = subprocess.run(cmd, env=dict(os.environ, LD_LIBRARY_PATH=str(bin_dir)), check=True, capture_output=True,
                         text=True).stdout
    return 1000 / json.loads(out)[0]["avg_ts"]


def per_hop(bin_dir: Path, gguf: Path, blocks: int, servers: int, rounds: int, tokens: int,
            head: str = "local") -> dict[str, dict[str, float]]:
    """Rounds alternating (order reversed every other round) between local and 1..`servers` RPC servers: per setup
    the median ms per token and the per-hop cost (median ms per token - local's) / servers."""
    ngl = blocks if head == "local" else 99
    with rpc_servers(bin_dir, servers) as addresses:
        setups = {"local": [], **{f"{k} rpc": addresses[:k] for k in range(1, servers + 1)}}
        runs: dict[str, list[float]] = {name: [] for name in setups}
        for name, rpc in setups.items():
            bench_ms(bin_dir, gguf, 8, rpc, ngl)  # warm-up (page cache, the servers' first graph)
        for r in range(rounds):
            for name in (list(setups) if r % 2 == 0 else list(setups)[::-1]):
                runs[name].append(bench_ms(bin_dir, gguf, tokens, setups[name], ngl))
    medians = [statistics.median(runs[name]) for name in setups]
    result = {}
    for hops, name in enumerate(setups):
        ms = medians[hops]
        result[name] = {"ms per token": ms, "per hop": (ms - medians[0]) / hops if hops else 0.0,
                        "added server": ms - medians[hops - 1] if hops else 0.0}
    return result


def table_rows(result: dict[str, dict[str, float]]) -> list[str]:
    """One line per setup: ms per token, per hop ((- local) / servers) and what the last server added (- the setup
    with one server fewer: local's and the servers' different memory (mmap'd file vs copied buffers) cancel out)."""
    rows = [f"{'llama.cpp':10s} {'ms/token':>9s} {'per hop':>9s} {'+1 server':>9s}"]
    for name, row in result.items():
        hop, added = (("-", "-") if name == "local" else (f"{row['per hop']:.3f}", f"{row['added server']:.3f}"))
        rows.append(f"{name:10s} {row['ms per token']:9.3f} {hop:>9s} {added:>9s}")
    return rows


def main() -> None:
    from swarmlm.machine import machine_line
    from swarmlm.model.checkpoint import load_config
    from swarmlm.model.random_checkpoint import default_checkpoint

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llamacpp", type=Path, required=True, help="llama.cpp's build/bin (llama-bench, ggml-rpc-server)")
    ap.add_argument("--converter", type=Path, help="convert_hf_to_gguf.py (default: two levels above --llamacpp)")
    ap.add_argument("--preset", default="tiny-bloom")
    ap.add_argument("--servers", type=int, default=3, help="RPC servers: 1..N, each a setup")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--head", choices=("local", "remote"), default="local",
                    help="the LM head in the client (-ngl L, as swarmlm) or on the last server (-ngl 99)")
    args = ap.parse_args()
    print("machine:", machine_line(), flush=True)
    checkpoint = default_checkpoint(args.preset)
    gguf = gguf_f32(Path(checkpoint), args.converter or converter_of(args.llamacpp))
    print("load average (1, 5, 15 min) at start: %.2f %.2f %.2f" % os.getloadavg(), flush=True)
    result = per_hop(args.llamacpp, gguf, int(load_config(str(checkpoint)).num_hidden_layers), args.servers,
                     args.rounds, args.tokens, args.head)
    print("load average (1, 5, 15 min) at end: %.2f %.2f %.2f" % os.getloadavg())
    print(f"llama-bench tg {args.tokens} tokens, -t 1, LM head {args.head}; medians of {args.rounds} rounds, ms")
    print("\n".join(table_rows(result)))


if __name__ == "__main__":
    main()
