"""float32 vs bfloat16 on this CPU, side by side: should `--dtype auto` keep a bf16 checkpoint in bf16 here?

For one preset's checkpoint (default bloomz-560m, `swarmlm.model.random_checkpoint.default_checkpoint`):
- server: a `Stage` of the first K blocks (default 6) per dtype; prefill of P tokens (default 100, one row) and
  one decode step at 1 and 8 rows (after a P-token prefill of those rows);
- client: the LM head (`load_client_modules` + `swarmlm.client.model.lm_head`, as generate runs it) at 1 and 8
  rows per dtype;
- accuracy: relative L2 error of bf16 vs fp32 on the same input: the Stage's hidden states after the prefill and
  the logits (final norm + head of those hidden states, each dtype through its own modules).
Inputs are the embeddings (fp32, through the client's embedding and its norm) of random token ids. Rounds
interleave the dtypes (fp32, bf16, fp32, ...) so machine noise hits both alike; after one warm-up round, medians.

    .venv/bin/python benchmarks/dtype_bench.py [--preset bloomz-560m] [--blocks 6] [--rounds 7] [--threads 1]
        [--out docs/results/dtype_bench.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from swarmlm.client.model import lm_head
from swarmlm.machine import machine_info
from swarmlm.model.checkpoint import DTYPES, cpu_has_bf16_matmul, load_client_modules
from swarmlm.model.random_checkpoint import default_checkpoint
from swarmlm.server.stage import SpanState, Stage
from swarmlm.types import BlockRange


def _ms(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref.float()).norm() / ref.float().norm())


def run(preset: str, blocks: int, prompt: int, rows: list[int], rounds: int, decode_steps: int,
        dtypes: list[str], seed: int) -> dict:
    ckpt = default_checkpoint(preset)
    gen = torch.Generator().manual_seed(seed)
    stages = {d: Stage(str(ckpt), BlockRange(0, blocks), d) for d in dtypes}
    clients = {d: load_client_modules(ckpt, d)[2] for d in dtypes}
    ref = clients["float32"]
    vocab = int(stages["float32"].config.vocab_size)
    max_len = prompt + (rounds + 1) * decode_steps  # what a decode session reaches, warm-up round included
    with torch.inference_mode():
        ids = torch.randint(0, vocab, (max(rows), max_len), generator=gen)
        emb = ref.embed(ids)
        if ref.embed_norm is not None:
            emb = ref.embed_norm(emb)
        emb = emb.float()  # the wire delivers what the client sends; each Stage casts to its own dtype

    # sessions for decode: one per dtype and row count, prefilled (untimed) with P tokens of `rows` rows
    sessions: dict[tuple[str, int], SpanState] = {}
    for d, st in stages.items():
        for r in rows:
            sessions[d, r] = st.new_state(st.blocks, r, max_len)
            st.step(sessions[d, r], emb[:r, :prompt], torch.ones(r, prompt, dtype=torch.long))
    step_no = {key: 0 for key in sessions}

    def prefill(d: str) -> float:
        st = stages[d]
        state = st.new_state(st.blocks, 1, prompt)
        return _ms(lambda: st.step(state, emb[:1, :prompt], torch.ones(1, prompt, dtype=torch.long)))

    def decode(d: str, r: int) -> float:
        times = []
        for _ in range(decode_steps):
            pos = prompt + step_no[d, r]
            step_no[d, r] += 1
            x = emb[:r, pos:pos + 1]
            times.append(_ms(lambda: stages[d].step(sessions[d, r], x, torch.ones(r, 1, dtype=torch.long))))
        return statistics.median(times)

    def head(d: str, r: int) -> float:
        # [r, 1, H]: one new token per row, with plain strides as the client's final norm hands it over. A slice
        # like emb[:1, -1:] keeps an outsized stride on its size-1 dim, and torch 2.13's bf16/fp16 linear then
        # takes ~4 s instead of ~50 ms for this head (fp32 does not care)
        x = emb[:r, -1:].to(DTYPES[d], memory_format=torch.contiguous_format)
        with torch.inference_mode():
            return _ms(lambda: lm_head(clients[d].lm_head, x))

    cases: dict[str, Callable[[str], float]] = {f"prefill {prompt} tok": prefill}
    for r in rows:
        cases[f"decode {r} row{'s' * (r > 1)}"] = lambda d, r=r: decode(d, r)
    for r in rows:
        cases[f"LM head {r} row{'s' * (r > 1)}"] = lambda d, r=r: head(d, r)

    samples: dict[str, dict[str, list[float]]] = {c: {d: [] for d in dtypes} for c in cases}
    for i in range(rounds + 1):  # round 0 warms up (oneDNN builds its bf16 kernels on first use)
        for case, fn in cases.items():
            for d in (dtypes if i % 2 == 0 else dtypes[::-1]):
                t = fn(d)
                if i > 0:
                    samples[case][d].append(t)
        print(f"round {i}/{rounds} done", flush=True)

    # accuracy: the same prompt through each dtype's stage, then each dtype's final norm and head
    accuracy: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        out = {}
        for d, st in stages.items():
            hidden = st.forward(st.blocks, emb[:1, :prompt], torch.ones(1, prompt, dtype=torch.long))
            c = clients[d]
            out[d] = hidden, lm_head(c.lm_head, c.final_norm(hidden))
        for d in dtypes:
            if d != "float32":
                accuracy[d] = {"hidden_rel_l2": _rel_l2(out[d][0], out["float32"][0]),
                               "logits_rel_l2": _rel_l2(out[d][1], out["float32"][1]),
                               "argmax_agree": float((out[d][1].argmax(-1) == out["float32"][1].argmax(-1))
                                                     .float().mean())}
    medians = {c: {d: statistics.median(v) for d, v in per.items()} for c, per in samples.items()}
    return {"medians_ms": medians, "samples_ms": samples, "accuracy": accuracy}


def table(res: dict, dtypes: list[str]) -> str:
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    head = "| | " + " | ".join(f"{short[d]} ms" for d in dtypes) + " | " + " | ".join(
        f"fp32 / {short[d]}" for d in dtypes if d != "float32") + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for case, per in res["medians_ms"].items():
        ratios = [per["float32"] / per[d] for d in dtypes if d != "float32"]
        lines.append(f"| {case} | " + " | ".join(f"{per[d]:.1f}" for d in dtypes) + " | "
                     + " | ".join(f"{x:.2f}x" for x in ratios) + " |")
    for d, acc in res["accuracy"].items():
        lines.append(f"\n{short[d]} vs fp32, same prompt: hidden rel L2 {acc['hidden_rel_l2']:.2e}, logits rel L2 "
                     f"{acc['logits_rel_l2']:.2e}, argmax agrees at {acc['argmax_agree']:.0%} of positions")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="bloomz-560m")
    p.add_argument("--blocks", type=int, default=6, help="K: the Stage holds blocks [0, K)")
    p.add_argument("--prompt", type=int, default=100, help="prefill tokens")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="decode / LM head rows")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--decode-steps", type=int, default=3, help="decode steps per round (their median counts)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES),
                   help="float32 (the reference, always run) and the ones to compare with it")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="docs/results/dtype_bench.json")
    args = p.parse_args()
    dtypes = ["float32"] + [d for d in args.dtypes if d != "float32"]
    torch.set_num_threads(args.threads)
    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()
    res = run(args.preset, args.blocks, args.prompt, args.rows, args.rounds, args.decode_steps, dtypes, args.seed)
    env = {"date_utc": started.strftime("%Y-%m-%d %H:%M UTC"), "loadavg_before": load_before,
           "loadavg_after": os.getloadavg(), "torch": torch.__version__, "threads": args.threads,
           "cpu_has_bf16_matmul": cpu_has_bf16_matmul(), "machine": machine_info()}
    report = {"preset": args.preset, "blocks": args.blocks, "prompt": args.prompt, "rows": args.rows,
              "rounds": args.rounds, "decode_steps": args.decode_steps, "dtypes": dtypes, "env": env, **res}
    print(json.dumps(env))
    print(table(res, dtypes))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
