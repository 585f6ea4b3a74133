"""int8 and compressed activations on trained weights: SmolLM2-135M-Instruct through real server processes vs
plain transformers in float32; and the same model's time to first token and tokens/s through 3 servers vs one
process.

Accuracy (teacher-forced, so every configuration is scored on the same tokens): for each prompt of the built-in
set (chat-templated), the fp32 reference greedily generates 32 tokens; the whole sequence then goes through the
swarm in one pass and the logits at the 32 positions that predicted those tokens are compared: relative L2 error
||got - ref|| / ||ref|| per prompt, and at how many of the 32 positions the argmax (the greedy choice) is the
reference's. (The reference runs 32 tokens even past an end of turn: min_new_tokens.)

    python benchmarks/trained_accuracy.py --prompts 32 --servers 2          # accuracy table
    python benchmarks/trained_accuracy.py --speed --prompts 8 --servers 3   # TTFT, tokens/s vs one process
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from swarmlm.bench.workload import builtin_prompts
from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.model.catalog import DEFAULT_MODEL, fetch
from swarmlm.model.checkpoint import load_tokenizer, load_transformers_model
from swarmlm.swarm.local import LocalSwarm, even_split

NEW_TOKENS = 32
CONFIGS = [  # (server --quant, client quant, wire dtype)
    ("none", "none", "float32"), ("int8", "int8", "float32"),
    ("none", "none", "float16"), ("none", "none", "bfloat16"), ("none", "none", "int8"),
]


def chat_ids(tokenizer, text: str) -> torch.Tensor:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]


def reference(local, prompts: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(prompt + 32 greedy tokens, the fp32 logits that chose them) per prompt."""
    out = []
    with torch.inference_mode():
        for ids in prompts:
            seq = local.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, min_new_tokens=NEW_TOKENS)
            out.append((seq, local(seq).logits[0, ids.shape[1] - 1:-1]))
    return out


def score(client, refs, prompt_lens) -> tuple[list[float], list[int]]:
    errors, agree = [], []
    with torch.inference_mode():
        for (seq, want), n in zip(refs, prompt_lens):
            got = client(seq).logits[0, n - 1:-1].float()
            errors.append(((got - want).norm() / want.norm()).item())
            agree.append(int((got.argmax(-1) == want.argmax(-1)).sum()))
    return errors, agree


def accuracy(model_dir: str, n_prompts: int, servers: int, threads: int) -> None:
    tokenizer = load_tokenizer(model_dir)
    prompts = [chat_ids(tokenizer, p.text) for p in builtin_prompts()[:n_prompts]]
    local = load_transformers_model(model_dir)
    refs = reference(local, prompts)
    lens = [p.shape[1] for p in prompts]
    print(f"| servers --quant | client --quant | --wire-dtype | rel. L2 median | max "
          f"| top-1 agree (of {NEW_TOKENS * len(prompts)}) | prompts with all {NEW_TOKENS} |")
    print("|---|---|---|---|---|---|---|")
    for server_quant in ("none", "int8"):
        with LocalSwarm(model_dir, threads=threads, server_args=["--quant", server_quant]) as swarm:
            swarm.start(even_split(30, servers))
            for sq, client_quant, wire in CONFIGS:
                if sq != server_quant:
                    continue
                client = DistributedModelForCausalLM.from_pretrained(
                    model_dir, initial_peers=swarm.initial_peers, quant=client_quant, wire_dtype=wire, threads=threads)
                errors, agree = score(client, refs, lens)
                client.close()
                print(f"| {sq} | {client_quant} | {wire} | {statistics.median(errors):.2e} | {max(errors):.2e} | "
                      f"{sum(agree)} | {sum(a == NEW_TOKENS for a in agree)} of {len(agree)} |", flush=True)


def speed(model_dir: str, n_prompts: int, servers: int, threads: int) -> None:
    tokenizer = load_tokenizer(model_dir)
    prompts = [chat_ids(tokenizer, p.text) for p in builtin_prompts()[:n_prompts]]
    local = load_transformers_model(model_dir)
    rows = {"swarm": ([], []), "one process": ([], [])}
    with LocalSwarm(model_dir, threads=threads) as swarm:
        swarm.start(even_split(30, servers))
        client = DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers,
                                                             threads=threads)
        for ids in prompts:  # side by side, prompt by prompt (the machine is shared: the same load for both)
            mask = torch.ones_like(ids)
            client.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                            min_new_tokens=NEW_TOKENS)
            rows["swarm"][0].append(client.last_stats.ttft_s)
            rows["swarm"][1].append(client.last_stats.tokens_per_s)
            with torch.inference_mode():
                t0 = time.perf_counter()
                local.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
                ttft = time.perf_counter() - t0
                t0 = time.perf_counter()
                local.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                               min_new_tokens=NEW_TOKENS)
                total = time.perf_counter() - t0
            rows["one process"][0].append(ttft)
            rows["one process"][1].append((NEW_TOKENS - 1) / (total - ttft))
        client.close()
    print(f"| | TTFT median s | tokens/s median | ({len(prompts)} chat prompts, {NEW_TOKENS} new tokens, "
          f"{threads} thread per process, {servers} servers) |")
    print("|---|---|---|---|")
    for name, (ttft, tps) in rows.items():
        print(f"| {name} | {statistics.median(ttft):.3f} | {statistics.median(tps):.1f} | |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--speed", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = str(fetch(args.model)) if args.model == DEFAULT_MODEL else args.model
    (speed if args.speed else accuracy)(model_dir, args.prompts, args.servers, args.threads)


if __name__ == "__main__":
    main()
