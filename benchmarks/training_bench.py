"""One training step through the swarm vs the same step locally (issue 27): batch 4 x 128 tokens, a client LoRA
(r = 8 on every block's attention input projection) and a soft prompt (ptune, 16 tokens), through 2 server
processes (fp32, then int8 servers) and in plain transformers + PEFT in this process. Per step: wall time (medians
of --steps, after one warm-up step), bytes sent and received by the training RPCs. Results ->
docs/RESULTS-finetune.md.

    .venv/bin/python benchmarks/training_bench.py [--model small-bloom] [--steps 3] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from swarmlm.client.model import DistributedModelForCausalLM  # noqa: E402
from swarmlm.machine import machine_info  # noqa: E402
from swarmlm.model.random_checkpoint import init_checkpoint  # noqa: E402
from swarmlm.swarm.local import LocalSwarm, even_split  # noqa: E402

ROWS, TOKENS, PROMPT, RANK = 4, 128, 16, 8


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (ROWS, TOKENS), generator=torch.Generator().manual_seed(0))
    return ids, ids.clone()


def _timed_steps(params, loss_fn, steps: int) -> list[float]:
    opt = torch.optim.AdamW(params, lr=1e-3)
    times = []
    for _ in range(steps + 1):  # the first: warm-up
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn().backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times[1:]


def _targets(family: str) -> list[str]:
    return ["query_key_value"] if family == "bloom" else ["q_proj", "v_proj"]


def local(path: str, family: str, mode: str, steps: int) -> list[float]:
    from peft import LoraConfig, PromptTuningConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = (LoraConfig(r=RANK, lora_alpha=16, target_modules=_targets(family), lora_dropout=0.0,
                         task_type="CAUSAL_LM") if mode == "lora"
              else PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=PROMPT))
    model = get_peft_model(base, config)
    ids, labels = _batch(base.config.vocab_size)
    params = [p for p in model.parameters() if p.requires_grad]
    return _timed_steps(params, lambda: model(input_ids=ids, labels=labels).loss, steps)


def swarm(path: str, family: str, mode: str, steps: int, addresses: list[str]) -> tuple[list[float], float, float]:
    tuning = (dict(tuning_mode="lora", lora_r=RANK, lora_alpha=16, lora_target_modules=_targets(family))
              if mode == "lora" else dict(tuning_mode="ptune", pre_seq_len=PROMPT))
    model = DistributedModelForCausalLM.from_pretrained(path, servers=addresses, dtype="float32", **tuning)
    ids, labels = _batch(model.config.vocab_size)
    params = [p for p in model.parameters() if p.requires_grad]
    sent0, received0 = model.trainer.bytes_sent, model.trainer.bytes_received
    times = _timed_steps(params, lambda: model(ids, labels=labels).loss, steps)
    per_step = steps + 1
    sent = (model.trainer.bytes_sent - sent0) / per_step
    received = (model.trainer.bytes_received - received0) / per_step
    model.close()
    return times, sent, received


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small-bloom", help="a preset (random weights)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = str(init_checkpoint(args.model, Path(tempfile.gettempdir()) / f"swarmlm-bench-{args.model}", seed=0))
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    family, blocks = cfg.model_type, int(cfg.num_hidden_layers)
    rows = []
    for mode in ("lora", "ptune"):
        rows.append(dict(mode=mode, where="local", step_s=statistics.median(local(path, family, mode, args.steps))))
    for quant in ("none", "int8"):
        with LocalSwarm(path, threads=args.threads, with_dht=False, server_args=["--quant", quant]) as live:
            live.start(even_split(blocks, 2))
            for mode in ("lora", "ptune"):
                times, sent, received = swarm(path, family, mode, args.steps, live.addresses)
                rows.append(dict(mode=mode, where=f"2 servers ({quant})", step_s=statistics.median(times),
                                 sent_mb=sent / 2**20, received_mb=received / 2**20))
    print(json.dumps(dict(model=args.model, rows=rows, steps=args.steps, batch=[ROWS, TOKENS],
                          machine=machine_info()), indent=1))
    print("| tuning | where | step (median, s) | vs local | MiB sent / received per step |")
    print("|---|---|---|---|---|")
    for r in rows:
        base = next(x["step_s"] for x in rows if x["mode"] == r["mode"] and x["where"] == "local")
        traffic = f"{r['sent_mb']:.1f} / {r['received_mb']:.1f}" if "sent_mb" in r else "-"
        print(f"| {r['mode']} | {r['where']} | {r['step_s']:.2f} | {r['step_s'] / base:.2f}x | {traffic} |")


if __name__ == "__main__":
    main()
