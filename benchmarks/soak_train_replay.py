"""Replays a soak's training requests (swarmlm/bench/soak_clients.py `train`) on a swarm with no fault, beside
transformers + PEFT: were a loop's losses the swarm's fault, a failover's, or the optimizer's?

For each request (its prompt and seed rebuilt from the client's seed): the swarm's LoRA loop as the soak ran it, and
at every step the same adapter (saved as PEFT's) in PEFT on transformers: its loss and gradients beside the swarm's;
then the whole loop in PEFT alone from the same initial adapter. Prints one JSON line per request.

    .venv/bin/python benchmarks/soak_train_replay.py /tmp/soak-hour/client7-train.jsonl --client-seed 7 \\
        --model-dir /tmp/soak-hour/tiny-llama --wrong --ok 5
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from swarmlm.bench.soak_clients import TRAIN_LR, TRAIN_STEPS, Checker, peft_losses, prompts  # noqa: E402
from swarmlm.client.tuning import _file_keys, save_adapter  # noqa: E402
from swarmlm.swarm.local import LocalSwarm  # noqa: E402
from swarmlm.types import BlockRange  # noqa: E402


def requests(log: Path, client_seed: int, tok) -> list[tuple[torch.Tensor, int, dict]]:
    """(prompt, seed, logged row) of every request of the client's log, in order."""
    rows = [json.loads(line) for line in log.read_text().splitlines() if '"kind"' in line]
    rng = random.Random(client_seed)
    return [(prompts(tok, rng), rng.randrange(1 << 30), row) for row in rows]


def peft_of(checker: Checker, base, workdir: Path):
    from peft import PeftModel

    save_adapter(checker.model, workdir, "base")
    return PeftModel.from_pretrained(base, workdir, is_trainable=True)


def peft_grads(peft) -> dict[str, torch.Tensor]:
    return {n.replace(".default", ""): p.grad for n, p in peft.named_parameters() if p.grad is not None}


def replay(checker: Checker, ids: torch.Tensor, seed: int, model_dir: str) -> dict:
    from transformers import AutoModelForCausalLM

    model = checker.model
    torch.manual_seed(seed)
    for name, p in model.named_parameters():  # (as soak_clients.Checker._train)
        if p.requires_grad:
            with torch.no_grad():
                p.zero_() if ".b." in name else p.normal_(std=0.1)
    alone_losses = peft_losses(model, model_dir, ids)  # the whole loop in PEFT alone, from the initial adapter
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=TRAIN_LR)
    swarm_losses, same_losses, grad_diff, grad_max = [], [], [], []
    for step in range(TRAIN_STEPS + 1):
        with tempfile.TemporaryDirectory() as tmp:
            peft = peft_of(checker, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           Path(tmp) / "a")
        opt.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        ref = peft(input_ids=ids, labels=ids).loss
        ref.backward()
        swarm_losses.append(loss.item())
        same_losses.append(ref.item())
        want = peft_grads(peft)
        got = {k: p.grad for k, p in _file_keys(model).items()}
        grad_diff.append(max((got[k] - want[k]).abs().max().item() for k in got))
        grad_max.append(max(g.abs().max().item() for g in got.values()))
        opt.step()
    return {"tokens": ids.shape[1], "swarm": swarm_losses, "peft_same_adapter": same_losses,
            "max_grad_diff": max(grad_diff), "max_grad": max(grad_max), "peft_alone": alone_losses}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log", type=Path)
    p.add_argument("--client-seed", type=int, required=True, help="the soak's seed * 100 + the client's index")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--wrong", action="store_true", help="replay the requests the soak counted wrong")
    p.add_argument("--ok", type=int, default=0, help="and this many of the others (the first ones)")
    args = p.parse_args()
    torch.set_num_threads(1)
    with LocalSwarm(args.model_dir) as swarm:
        swarm.start_dht()
        swarm.wait_ready([swarm.start_server(BlockRange(0, 3), wait=False),
                          swarm.start_server(BlockRange(3, 6), wait=False)])
        checker = Checker("train", args.model_dir, swarm.initial_peers, "", "")
        todo = requests(args.log, args.client_seed, checker.tok)
        chosen = [r for r in todo if args.wrong and r[2]["wrong"]] + [r for r in todo if not r[2]["wrong"]][:args.ok]
        for ids, seed, row in chosen:
            out = {"soak_wrong": row["wrong"], **replay(checker, ids, seed, args.model_dir)}
            print(json.dumps(out), flush=True)
        checker.model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
