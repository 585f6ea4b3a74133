"""One training step through the swarm vs the same step locally (issue 27): batch 4 x 128 tokens, a client LoRA
(r = 8 on every block's attention input projection) and a soft prompt (ptune, 16 tokens), through 2 (or --servers)
server processes (fp32, then int8 servers) and in plain transformers + PEFT in this process, their steps alternated (the machine
may be shared: both see the same load). Per step: wall times and their ratio (medians of --steps pairs, after one
warm-up step each), bytes sent and received by the training RPCs. Results ->
docs/RESULTS-finetune.md.

    .venv/bin/python benchmarks/training_bench.py [--model small-bloom] [--steps 3] [--threads 1]
    .venv/bin/python benchmarks/training_bench.py --model bloomz-560m --servers 2,4 --quant none --modes lora
    .venv/bin/python benchmarks/training_bench.py --with-inference   # training beside 4 decode sessions
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


class Trainer:
    """One model and its optimizer: `step()` runs one timed optimizer step on the fixed batch."""

    def __init__(self, model, loss_fn) -> None:
        self.model, self.loss_fn = model, loss_fn
        self.opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def step(self) -> float:
        t0 = time.perf_counter()
        self.opt.zero_grad()
        self.loss_fn().backward()
        self.opt.step()
        return time.perf_counter() - t0


def _targets(family: str) -> list[str]:
    return ["query_key_value"] if family == "bloom" else ["q_proj", "v_proj"]


def local(path: str, family: str, mode: str) -> Trainer:
    from peft import LoraConfig, PromptTuningConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = (LoraConfig(r=RANK, lora_alpha=16, target_modules=_targets(family), lora_dropout=0.0,
                         task_type="CAUSAL_LM") if mode == "lora"
              else PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=PROMPT))
    model = get_peft_model(base, config)
    ids, labels = _batch(base.config.vocab_size)
    return Trainer(model, lambda: model(input_ids=ids, labels=labels).loss)


def swarm(path: str, family: str, mode: str, addresses: list[str]) -> Trainer:
    tuning = (dict(tuning_mode="lora", lora_r=RANK, lora_alpha=16, lora_target_modules=_targets(family))
              if mode == "lora" else dict(tuning_mode="ptune", pre_seq_len=PROMPT))
    model = DistributedModelForCausalLM.from_pretrained(path, servers=addresses, dtype="float32", **tuning)
    ids, labels = _batch(model.config.vocab_size)
    return Trainer(model, lambda: model(ids, labels=labels).loss)


def side_by_side(path: str, family: str, mode: str, steps: int, addresses: list[str]) -> dict:
    """Local and swarm steps alternated (one warm-up each), so both see the same load on a shared machine."""
    here, there = local(path, family, mode), swarm(path, family, mode, addresses)
    here.step(), there.step()
    trainer = there.model.trainer
    sent0, received0 = trainer.bytes_sent, trainer.bytes_received
    pairs = [(here.step(), there.step()) for _ in range(steps)]
    row = dict(mode=mode, local_s=statistics.median(p[0] for p in pairs),
               swarm_s=statistics.median(p[1] for p in pairs),
               ratio=statistics.median(p[1] / p[0] for p in pairs),
               sent_mb=(trainer.bytes_sent - sent0) / steps / 2**20,
               received_mb=(trainer.bytes_received - received0) / steps / 2**20)
    there.model.close()
    return row


def decode_times(path: str, addresses: list[str], sessions: int, tokens: int, stop=None) -> list[float]:
    """`sessions` greedy decode sessions at once (one thread each), `tokens` steps each; every step's seconds."""
    import threading

    client = DistributedModelForCausalLM.from_pretrained(path, servers=addresses, dtype="float32")
    times: list[float] = []

    def one(seed: int) -> None:
        ids = torch.randint(0, client.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad(), client.inference_session(max_length=16 + tokens) as session:
            logits = client.step_logits(session, ids, last_only=True)
            for _ in range(tokens):
                t0 = time.perf_counter()
                logits = client.step_logits(session, logits[:, -1:].argmax(-1), last_only=True)
                times.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    client.close()
    return times


def with_inference(path: str, family: str, addresses: list[str], steps: int) -> dict:
    """Training steps (LoRA) while 4 decode sessions run on the same servers, vs each alone."""
    import threading

    alone_decode = statistics.median(decode_times(path, addresses, 4, 24))
    trainer = swarm(path, family, "lora", addresses)
    trainer.step()
    alone_train = statistics.median(trainer.step() for _ in range(steps))
    decode: list[float] = []
    thread = threading.Thread(target=lambda: decode.extend(decode_times(path, addresses, 4, 24)))
    thread.start()
    train = []
    while thread.is_alive():
        train.append(trainer.step())
    thread.join()
    trainer.model.close()
    return dict(decode_alone_s=alone_decode, decode_with_training_s=statistics.median(decode),
                train_alone_s=alone_train, train_with_decode_s=statistics.median(train), train_steps=len(train),
                train_tokens_per_s=ROWS * TOKENS / statistics.median(train))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small-bloom", help="a preset (random weights)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--servers", default="2", help="server counts to run, comma-separated (e.g. 2,4)")
    ap.add_argument("--quant", default="none,int8", help="server weight formats to run, comma-separated")
    ap.add_argument("--modes", default="lora,ptune", help="tuning modes to run, comma-separated")
    ap.add_argument("--with-inference", action="store_true",
                    help="only: LoRA training steps while 4 decode sessions run on the same (fp32) servers")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = str(init_checkpoint(args.model, Path(tempfile.gettempdir()) / f"swarmlm-bench-{args.model}", seed=0))
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    family, blocks = cfg.model_type, int(cfg.num_hidden_layers)
    if args.with_inference:
        with LocalSwarm(path, threads=args.threads, with_dht=False) as live:
            live.start(even_split(blocks, 2))
            result = with_inference(path, family, live.addresses, args.steps)
        print(json.dumps(dict(model=args.model, **result, machine=machine_info()), indent=1))
        return
    rows = []
    print(HEADER, flush=True)
    for quant in args.quant.split(","):
        for count in (int(n) for n in args.servers.split(",")):
            with LocalSwarm(path, threads=args.threads, with_dht=False, server_args=["--quant", quant]) as live:
                live.start(even_split(blocks, count))
                for mode in args.modes.split(","):
                    rows.append(dict(servers=quant, count=count,
                                     **side_by_side(path, family, mode, args.steps, live.addresses)))
                    print(_table_row(rows[-1]), flush=True)
    print(json.dumps(dict(model=args.model, rows=rows, steps=args.steps, batch=[ROWS, TOKENS],
                          machine=machine_info()), indent=1))


HEADER = ("| tuning | servers | local step (median, s) | swarm step (median, s) | ratio (median of pairs) | "
          "MiB sent / received per step |\n|---|---|---|---|---|---|")


def _table_row(r: dict) -> str:
    return (f"| {r['mode']} | {r['count']} x {r['servers']} | {r['local_s']:.2f} | {r['swarm_s']:.2f} | "
            f"{r['ratio']:.2f}x | {r['sent_mb']:.1f} / {r['received_mb']:.1f} |")


if __name__ == "__main__":
    main()
