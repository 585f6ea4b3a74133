"""int8 against fp32 on this CPU, and with the kernels of an AVX2-only CPU: logits error, greedy agreement, speed.

In one process per kernel set, the model of a preset (random weights) in fp32 and the same with what `--quant int8`
quantizes on servers and client (every linear layer, the LM head, the embeddings; swarmlm/model/quant.py):
- accuracy: the prompts' logits (relative L2 to fp32, per prompt) and how many of the first --new greedy tokens
  agree (up to the first difference), --prompts prompts of 16 tokens, generated as one batch;
- speed: one-row decode steps (a prefill of 16 tokens, then --steps steps with a cache), fp32 and int8 rounds
  interleaved, median per-token time per round; "x" = int8 time / fp32 time.

`--kernels native,avx2` runs one child process per set: "native" as the CPU is, "avx2" with fbgemm, torch, oneDNN
and MKL told to use AVX2 only (tests/test_quant.py AVX2_ONLY), which is what an AVX2-only CPU (AMD Zen 1-3, Intel
before Skylake-SP) runs. Usage:

    .venv/bin/python benchmarks/int8_cpu_bench.py [--preset bloomz-560m] [--prompts 16] [--new 32] [--rounds 3]
        [--steps 16] [--kernels native,avx2] [--out docs/results/int8_cpu.json]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicCache

from swarmlm.machine import machine_info, machine_line
from swarmlm.model.quant import Int8Embedding, Int8Linear, quantize_linears
from swarmlm.model.random_checkpoint import default_checkpoint

AVX2_ONLY = {"FBGEMM_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
KERNELS = {"native": {}, "avx2": AVX2_ONLY}


def models(preset: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(fp32, int8): blocks' linears, LM head and embeddings in int8, as int8 servers + an int8 client hold them."""
    fp32 = AutoModelForCausalLM.from_pretrained(default_checkpoint(preset)).eval()
    for p in fp32.parameters():
        p.data = p.data.clone()  # in process memory, as servers hold them (not the file's mapping)
    int8 = copy.deepcopy(fp32)
    int8.lm_head = copy.deepcopy(int8.lm_head)  # untied from the embeddings: each is quantized its own way
    quantize_linears(int8, "int8")
    int8.set_input_embeddings(Int8Embedding.from_embedding(int8.get_input_embeddings()))
    return fp32, int8


@torch.inference_mode()
def accuracy(fp32, int8, prompts: int, new: int) -> dict:
    ids = torch.tensor([list(range(10 + 7 * k, 26 + 7 * k)) for k in range(prompts)])  # [P, 16]
    want, got = fp32(ids).logits, int8(ids).logits
    rel = [float((g - w).norm() / w.norm()) for g, w in zip(got, want)]
    args = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
    a, b = fp32.generate(ids, **args)[:, 16:], int8.generate(ids, **args)[:, 16:]
    agree = [int((x != y).nonzero()[0, 0]) if (x != y).any() else new for x, y in zip(a, b)]
    return {"prompts": prompts, "logits_rel_l2_median": statistics.median(rel), "logits_rel_l2_max": max(rel),
            "greedy_tokens_agreeing": agree, "all_agree": sum(n == new for n in agree)}


@torch.inference_mode()
def decode_s_per_token(model, steps: int) -> float:
    cache = DynamicCache()
    out = model(torch.arange(10, 26)[None], past_key_values=cache, use_cache=True)
    nxt = out.logits[:, -1:].argmax(-1)
    t0 = time.perf_counter()
    for _ in range(steps):
        nxt = model(nxt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    return (time.perf_counter() - t0) / steps


def child(args) -> dict:
    torch.set_num_threads(1)
    print(machine_line(), "| reduce_range", Int8Linear.reduce_range, flush=True)
    fp32, int8 = models(args.preset)
    acc = accuracy(fp32, int8, args.prompts, args.new)
    print("accuracy:", json.dumps(acc), flush=True)
    times: dict[str, list[float]] = {"fp32": [], "int8": []}
    for r in range(args.rounds):
        for name in (("fp32", "int8") if r % 2 == 0 else ("int8", "fp32")):
            times[name].append(decode_s_per_token(fp32 if name == "fp32" else int8, args.steps))
    ratios = [i / f for i, f in zip(times["int8"], times["fp32"])]
    speed = {"fp32_ms": 1e3 * statistics.median(times["fp32"]), "int8_ms": 1e3 * statistics.median(times["int8"]),
             "int8_over_fp32": statistics.median(ratios), "rounds": args.rounds, "steps": args.steps,
             "load_avg": os.getloadavg()}
    print("speed:", json.dumps(speed), flush=True)
    return {"machine": machine_info(), "reduce_range": Int8Linear.reduce_range, "accuracy": acc, "speed": speed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bloomz-560m")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new", type=int, default=32, help="greedy tokens compared per prompt")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16, help="decode steps per speed round")
    ap.add_argument("--kernels", default="native,avx2")
    ap.add_argument("--out", default="docs/results/int8_cpu.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    report = {"args": vars(args), "started_load_avg": os.getloadavg(), "runs": {}}
    for kind in args.kernels.split(","):
        cmd = [sys.executable, __file__, "--child"] + [f"--{k}={v}" for k, v in vars(args).items()
                                                       if k not in ("child", "kernels", "out")]
        proc = subprocess.run(cmd, env={**os.environ, **KERNELS[kind]}, capture_output=True, text=True, check=True)
        lines = proc.stdout.splitlines()
        print(f"== {kind}\n" + "\n".join(line for line in lines if not line.startswith("RESULT ")), flush=True)
        report["runs"][kind] = json.loads(next(line for line in lines if line.startswith("RESULT "))[7:])
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))  # after each: a partial run is kept


if __name__ == "__main__":
    main()
