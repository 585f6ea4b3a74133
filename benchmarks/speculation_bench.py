"""Plain vs server-to-server push vs push + speculative decoding: tokens/s of greedy generation, side by side in one run.

For each N a fresh swarm (even split) on emulated hosts (netem testbed, `--network`, default wan: 50 ms RTT per
link), three clients on it: plain (push off), push (on), push + speculation (`--speculative`, default auto:
prompt-lookup drafts, the draft length from the measured acceptance and route cost). Every prompt runs through
the three in turn (order rotating per round, so background load hits all alike); tokens must be identical.
Two prompt sets: prompts that quote their input (repeat, correct, extract, continue a list) and open-ended ones,
each chat-templated for the model.

    .venv/bin/python benchmarks/speculation_bench.py --model ~/.cache/swarmlm/checkpoints/smollm2-135m-instruct \
        --servers 1,2,4,6 --tokens 48 --rounds 1

With `--batch B` (B > 1): the first B prompts of `--batch-set` (default quoting), left-padded, in ONE generate() call (a batched session),
plain vs push + speculation (the batch drafting at its slowest row's pace: client/decoding/decoder.py), alternating per
round:

    .venv/bin/python benchmarks/speculation_bench.py --model ~/.cache/swarmlm/checkpoints/smollm2-135m-instruct \
        --servers 4 --batch 4 --tokens 48 --rounds 3

With `--draft-model DIR` (a transformers checkpoint of the same tokenizer; `--draft-int8`: its linear layers
quantized to int8 in this process, e.g. the served model itself as a cheaper drafter): a fourth client, push +
speculation drafting with that model instead of prompt lookup (`generate(draft_model=...)`).

Generation is greedy and ends at the model's eos (the answer's end) or after --tokens. tokens/s = generated tokens /
the generate() call's wall time (TTFT included); decode tokens/s = (tokens - 1) / (wall - TTFT); medians over the
prompts x rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path

import torch
from transformers import AutoTokenizer

from swarmlm.bench.runner import BenchConfig, start_swarm
from swarmlm.bench.strategies import StrategyConfig
from swarmlm.client.model import DistributedModelForCausalLM

QUOTING = [  # answers that quote the prompt: correct, repeat, edit code, fix grammar, extract (16-48 tokens each)
    "Correct the spelling mistakes and give back the whole text: Yesterday I went to the libary to borow some books "
    "about histroy. The librarian was very frendly and helped me find a book about the ancient Romans and there empire.",
    "Repeat this paragraph exactly: The museum opens at nine in the morning and closes at six in the evening. Tickets "
    "cost twelve euros for adults and five euros for children under twelve. Guided tours start every hour from the "
    "main hall.",
    "Rename the function add to sum_two in this code and give back the whole code:\n```python\ndef add(a, b):\n    "
    "return a + b\n\n\ndef main():\n    total = add(1, 2)\n    print(add(total, 3))\n```",
    "Fix the grammar and give back the whole text: She go to school every days. He have two brother and one sister. "
    "They was playing football when it start to rain.",
    "Extract the names of all the cities in this text, one per line: Last year we travelled from Paris to Berlin, then "
    "took a train to Vienna and Prague, and finally flew from Prague to Rome and Madrid.",
]
OPEN_ENDED = [
    "Write a short poem about the sea.",
    "Why is the sky blue? Explain briefly.",
    "Give me three ideas for a weekend trip.",
    "What makes a good teacher?",
]
MODES = {  # name -> (ClientConfig.push, generate(speculative=...))
    "plain": ("off", "off"),
    "push": ("on", "off"),
    "push+spec": ("on", None),  # None: --speculative
}


def chat_ids(tokenizer, text: str) -> torch.Tensor:
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)["input_ids"]
    return tokenizer(text, return_tensors="pt").input_ids


def load_draft(path: str, int8: bool):
    """A local transformers model to draft with (float32; its linear layers int8 with `int8`)."""
    from transformers import AutoModelForCausalLM

    from swarmlm.model.quant import quantize_linears

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return quantize_linears(model, "int8" if int8 else "none")  # the servers' int8 (model/quant.py)


def run_n(args, n: int, num_blocks: int, prompt_sets: dict[str, list[torch.Tensor]], draft=None) -> dict:
    modes = {**MODES, **({"push+draft": ("on", None)} if draft is not None else {})}
    cfg = BenchConfig(model_dir=args.model, servers=(n,), strategies=(StrategyConfig("sequential"),),
                      network=args.network, netem_mode=args.netem_mode)
    rows: dict = {}
    with start_swarm(cfg, n, num_blocks) as swarm:
        # float32 on the wire (wire "auto" picks per measured link, so clients could differ): comparable tokens
        clients = {name: DistributedModelForCausalLM.from_pretrained(
            args.model, initial_peers=swarm.initial_peers, servers=swarm.server_addresses, push=push,
            routing="shortest", wire_dtype="float32") for name, (push, _) in modes.items()}
        try:
            for name, client in clients.items():  # warm-up (connections, RTT probes), not recorded
                client.generate(prompt_sets["quoting"][0], max_new_tokens=4, do_sample=False)
            for set_name, prompts in prompt_sets.items():
                results = {name: [] for name in modes}
                order = list(modes)
                for r in range(args.rounds):
                    for p, ids in enumerate(prompts):
                        order = order[1:] + order[:1]
                        for name in order:
                            spec = modes[name][1] or args.speculative
                            client = clients[name]
                            # a mask: without one transformers would mask the template's <|im_end|>, SmolLM2's pad
                            # token; generation ends at the model's eos (the answer's end), as a user's would
                            out = client.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens,
                                                  do_sample=False, speculative=spec,
                                                  draft_model=draft if name == "push+draft" else None)
                            st = client.last_stats
                            results[name].append({
                                "prompt": p, "round": r, "tokens": out[0, ids.shape[1]:].tolist(),
                                "tokens_per_s": st.new_tokens / st.total_s, "ttft_s": st.ttft_s,
                                "decode_tokens_per_s": (st.new_tokens - 1) / max(st.total_s - st.ttft_s, 1e-9),
                                "passes": len(st.steps), "pushed": all(s.pushed for s in st.steps),
                                "speculation": st.speculation})
                rows[set_name] = summarise(results)
        finally:
            for client in clients.values():
                client.close()
    return {"servers": n, "network_info": swarm.network_info, "sets": rows}


BATCH_MODES = ("plain", "push+spec")


def padded_batch(tokenizer, prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts [1, T_i] -> ids [B, T] left-padded with the pad token, and their mask (as a tokenizer pads them)."""
    width = max(p.shape[1] for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - p.shape[1]:], mask[i, width - p.shape[1]:] = p[0], 1
    return ids, mask


def run_batch_n(args, n: int, num_blocks: int, ids: torch.Tensor, mask: torch.Tensor) -> dict:
    """One generate() call for the whole batch per mode and round, modes alternating."""
    cfg = BenchConfig(model_dir=args.model, servers=(n,), strategies=(StrategyConfig("sequential"),),
                      network=args.network, netem_mode=args.netem_mode)
    with start_swarm(cfg, n, num_blocks) as swarm:
        clients = {name: DistributedModelForCausalLM.from_pretrained(
            args.model, initial_peers=swarm.initial_peers, servers=swarm.server_addresses, push=MODES[name][0],
            routing="shortest", wire_dtype="float32") for name in BATCH_MODES}
        results = {name: [] for name in BATCH_MODES}
        eos = set(clients["plain"].eos_token_id)  # generate()'s own (generation_config.json's)
        try:
            for client in clients.values():  # warm-up (connections, RTT probes), not recorded
                client.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=4, do_sample=False)
            order = list(BATCH_MODES)
            for r in range(args.rounds):
                order = order[::-1]
                for name in order:
                    client = clients[name]
                    out = client.generate(ids, attention_mask=mask, max_new_tokens=args.tokens, do_sample=False,
                                          speculative=MODES[name][1] or args.speculative)
                    st = client.last_stats
                    rows = [_until_eos(row[ids.shape[1]:], eos) for row in out.tolist()]
                    generated = sum(len(row) for row in rows)
                    results[name].append({
                        "round": r, "tokens": rows, "generated": generated, "tokens_per_s": generated / st.total_s,
                        "passes": len(st.steps), "pushed": all(s.pushed for s in st.steps),
                        "speculation": st.speculation})
        finally:
            for client in clients.values():
                client.close()
    plain = results["plain"][0]["tokens"]
    out = {}
    for name, items in results.items():
        spec = [x["speculation"] for x in items if x["speculation"]]
        out[name] = {
            **common_summary(items, spec),
            "tokens_per_pass": sum(x["generated"] for x in items) / sum(x["passes"] for x in items),
            "resent_per_row": [s["resent"] for s in spec[0]["rows"]] if spec else None,
            "rows_identical_to_plain": sum(a == b for a, b in zip(items[0]["tokens"], plain))}
    for name in out:
        out[name]["vs_plain"] = out[name]["tokens_per_s_median"] / out["plain"]["tokens_per_s_median"]
    return {"servers": n, "batch": int(ids.shape[0]), "network_info": swarm.network_info, "modes": out}


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens


def common_summary(items: list[dict], spec: list[dict]) -> dict:
    """What both benchmarks report of one client's runs (`spec`: their speculation stats)."""
    drafted = sum(s["drafted"] for s in spec)
    return {"tokens_per_s_median": statistics.median(x["tokens_per_s"] for x in items),
            "acceptance_rate": sum(s["accepted"] for s in spec) / drafted if drafted else None,
            "pushed": all(x["pushed"] for x in items), "runs": items}


def summarise(results: dict[str, list[dict]]) -> dict:
    plain = [x["tokens"] for x in results["plain"]]
    out = {}
    for name, items in results.items():
        spec = [x["speculation"] for x in items if x["speculation"]]
        out[name] = {
            **common_summary(items, spec),
            "decode_tokens_per_s_median": statistics.median(x["decode_tokens_per_s"] for x in items),
            "identical_to_plain": [x["tokens"] for x in items] == plain,
            "tokens_per_pass": sum(len(x["tokens"]) for x in items) / sum(x["passes"] for x in items),
            "mean_k": statistics.mean(s["mean_k"] for s in spec) if spec else None,
            "by_kind": _merge_by_kind(spec),
        }
    base = out["plain"]["tokens_per_s_median"]
    decode_base = out["plain"]["decode_tokens_per_s_median"]
    for name in out:
        out[name]["vs_plain"] = out[name]["tokens_per_s_median"] / base
        out[name]["decode_vs_plain"] = out[name]["decode_tokens_per_s_median"] / decode_base
    return out


def _merge_by_kind(spec: list[dict]) -> dict[str, list[int]]:
    """Drafted and accepted tokens per draft kind (prompt lookup: the matched n-gram length) over the runs."""
    out: dict[str, list[int]] = {}
    for s in spec:
        for kind, (drafted, accepted) in s.get("by_kind", {}).items():
            counts = out.setdefault(kind, [0, 0])
            counts[0] += drafted
            counts[1] += accepted
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--servers", default="1,2,4")
    ap.add_argument("--network", default="wan")
    ap.add_argument("--netem-mode", default="auto")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--speculative", default="auto")
    ap.add_argument("--batch", type=int, default=1, help="B > 1: B prompts in one batched generate()")
    ap.add_argument("--batch-set", default="quoting", choices=["quoting", "open-ended"], help="--batch's prompts")
    ap.add_argument("--draft-model", default=None, help="also push + speculation drafting with this local model")
    ap.add_argument("--draft-int8", action="store_true", help="the draft model's linear layers in int8")
    ap.add_argument("--out", default="docs/results/speculation")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    from transformers import AutoConfig

    num_blocks = AutoConfig.from_pretrained(args.model).num_hidden_layers
    sets = {"quoting": [chat_ids(tokenizer, t) for t in QUOTING],
            "open-ended": [chat_ids(tokenizer, t) for t in OPEN_ENDED]}
    results = {"args": vars(args), "cpu": platform.processor() or platform.machine(),
               "load_avg": os.getloadavg(), "runs": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.batch > 1:
        ids, mask = padded_batch(tokenizer, sets[args.batch_set][:args.batch])
        for n in (int(x) for x in args.servers.split(",")):
            run = run_batch_n(args, n, num_blocks, ids, mask)
            results["runs"].append(run)
            (out / f"speculation_batch_{args.batch_set}_bench.json").write_text(json.dumps(results, indent=1))
            for name, m in run["modes"].items():
                acc = m["acceptance_rate"]
                print(f"N={n} batch={run['batch']} {name:9s} {m['tokens_per_s_median']:6.2f} tok/s "
                      f"({m['vs_plain']:.2f}x plain) tokens/pass={m['tokens_per_pass']:.2f} "
                      f"acceptance={'' if acc is None else f'{acc:.2f}'} resent per row={m['resent_per_row']} "
                      f"rows identical to plain={m['rows_identical_to_plain']} pushed={m['pushed']}", flush=True)
        return
    draft = load_draft(args.draft_model, args.draft_int8) if args.draft_model else None
    name = "speculation_draft_bench.json" if draft is not None else "speculation_bench.json"
    for n in (int(x) for x in args.servers.split(",")):
        results["runs"].append(run_n(args, n, num_blocks, sets, draft))
        (out / name).write_text(json.dumps(results, indent=1))
        for set_name, modes in results["runs"][-1]["sets"].items():
            for mode, m in modes.items():
                acc = m["acceptance_rate"]
                print(f"N={n} {set_name:10s} {mode:10s} {m['tokens_per_s_median']:6.2f} tok/s "
                      f"({m['vs_plain']:.2f}x plain; decode {m['decode_tokens_per_s_median']:.2f} tok/s, "
                      f"{m['decode_vs_plain']:.2f}x) identical={m['identical_to_plain']} pushed={m['pushed']} "
                      f"tokens/pass={m['tokens_per_pass']:.2f} acceptance={'' if acc is None else f'{acc:.2f}'} "
                      f"mean k={m['mean_k']} by kind={m['by_kind']}", flush=True)


if __name__ == "__main__":
    main()
