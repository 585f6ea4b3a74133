"""Prompt lookup in one process, no swarm: forward passes per answer of transformers' own prompt lookup
(`prompt_lookup_num_tokens`) and of swarmlm's drafter + verification (client/decoding/drafting.py, client/decoding/verification.py)
with a fixed k and with the draft length rule (perf/speculation.py) on a given pass cost, on the prompt sets of
benchmarks/speculation_bench.py. Greedy, ending at eos; every run must give plain greedy's tokens.

    .venv/bin/python benchmarks/speculation_local.py --model ~/.cache/swarmlm/checkpoints/smollm2-135m-instruct

The rule's pass cost: route_s + compute_s + token_s (n - 1) for a pass of n tokens (defaults: push through 4
servers at 50 ms RTT, 30 blocks of SmolLM2-135M on this CPU); "time saved" is sum of pass costs, plain / speculative.
"""
from __future__ import annotations

import argparse
import statistics

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from benchmarks.speculation_bench import OPEN_ENDED, QUOTING, chat_ids
from swarmlm.client.decoding.drafting import PromptLookup
from swarmlm.client.decoding.verification import verify_greedy
from swarmlm.perf.speculation import AcceptanceByMatch, choose_draft_length


@torch.no_grad()
def speculate(model, ids: torch.Tensor, new_tokens: int, eos: int, k_max: int, cost, rule: bool) -> dict:
    """swarmlm's loop on a local DynamicCache: passes of [last] + drafts, rejected drafts cropped."""
    cache, lookup, estimate = DynamicCache(config=model.config), PromptLookup(), AcceptanceByMatch()
    logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1:]
    context, new = ids[0].tolist(), verify_greedy([], logits)
    passes, seconds, drafted, accepted = 1, 0.0, 0, 0
    while len(new) < new_tokens and new[-1] != eos:
        drafts, n = lookup.lookup(torch.tensor(context + new), min(k_max, new_tokens - len(new) - 1))
        if rule and drafts:
            drafts = drafts[:choose_draft_length(estimate.rate(n), cost, len(drafts))]
        logits = model(input_ids=torch.tensor([[new[-1]] + drafts]), past_key_values=cache, use_cache=True).logits[0]
        tokens = verify_greedy(drafts, logits)
        estimate.update(n if drafts else None, len(drafts), len(tokens) - 1)
        if len(tokens) - 1 < len(drafts):
            cache.crop(len(tokens) - 1 - len(drafts))
        passes, seconds = passes + 1, seconds + cost(len(drafts) + 1)
        drafted, accepted = drafted + len(drafts), accepted + len(tokens) - 1
        for t in tokens:
            if len(new) < new_tokens and new[-1] != eos:
                new.append(t)
    return {"tokens": new, "passes": passes, "seconds": seconds, "drafted": drafted, "accepted": accepted}


def transformers_passes(model, ids: torch.Tensor, new_tokens: int, eos: int, k: int | None) -> tuple[list[int], int]:
    calls = [0]
    hook = model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=eos, prompt_lookup_num_tokens=k)
    finally:
        hook.remove()
    return out[0, ids.shape[1]:].tolist(), calls[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=8, help="transformers' prompt_lookup_num_tokens and swarmlm's k_max")
    ap.add_argument("--route-s", type=float, default=0.125, help="a pass's link time (push, N = 4, 50 ms RTT)")
    ap.add_argument("--compute-s", type=float, default=0.061, help="one token through every block")
    ap.add_argument("--token-s", type=float, default=0.008, help="each further token of a pass")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos

    def cost(n: int) -> float:
        return args.route_s + args.compute_s + args.token_s * (n - 1)

    print("set        tokens  plain  transformers(k)  swarmlm(k)  swarmlm(rule)  rule: time saved, accepted/drafted")
    for set_name, prompts in (("quoting", QUOTING), ("open-ended", OPEN_ENDED)):
        saved = []
        for text in prompts:
            ids = chat_ids(tokenizer, text)
            plain, plain_passes = transformers_passes(model, ids, args.tokens, eos, None)
            tf, tf_passes = transformers_passes(model, ids, args.tokens, eos, args.k)
            fixed = speculate(model, ids, args.tokens, eos, args.k, cost, rule=False)
            rule = speculate(model, ids, args.tokens, eos, args.k, cost, rule=True)
            assert tf == plain and fixed["tokens"] == plain and rule["tokens"] == plain, text
            saved.append(((len(plain) - 1) * cost(1)) / rule["seconds"] if rule["seconds"] else 1.0)
            print(f"{set_name:10s} {len(plain):6d} {plain_passes:6d} {tf_passes:16d} {fixed['passes']:11d} "
                  f"{rule['passes']:14d}  {saved[-1]:.2f}x, {rule['accepted']}/{rule['drafted']}", flush=True)
        print(f"{set_name}: median time saved by the rule {statistics.median(saved):.2f}x")


if __name__ == "__main__":
    main()
