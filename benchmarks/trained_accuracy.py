"""Packed, int8 / int4 weights and compressed activations on trained weights: SmolLM2-135M-Instruct through real
server processes vs plain transformers in float32; and the same model's time to first token and tokens/s through 3
servers vs one process.

Accuracy (teacher-forced, so every configuration is scored on the same tokens): for each prompt of the built-in
set (chat-templated), the fp32 reference greedily generates 32 tokens; the whole sequence then goes through the
swarm in one pass and the logits at the 32 positions that predicted those tokens are compared: relative L2 error
||got - ref|| / ||ref|| per prompt, and at how many of the 32 positions the argmax (the greedy choice) is the
reference's. (The reference runs 32 tokens even past an end of turn: min_new_tokens.)

    python benchmarks/trained_accuracy.py --prompts 32 --servers 2          # the GGUF: packed vs dequantized
    python benchmarks/trained_accuracy.py --float --prompts 32 --servers 2  # its float32 copy: none / int8 / int4
    python benchmarks/trained_accuracy.py --speed --prompts 8 --servers 3   # TTFT, tokens/s vs one process

`--float` writes the GGUF's dequantized weights once as a float32 safetensors checkpoint (what a user's float model
is) and quantizes that on load; it also reports perplexity on a fixed text (PERPLEXITY_TEXT) per configuration.
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
CONFIGS = {  # (server --quant, client quant, wire dtype)
    "gguf": [("auto", "auto", "float32"), ("none", "none", "float32"), ("auto", "auto", "float16"),
             ("auto", "auto", "bfloat16"), ("auto", "auto", "int8")],
    "float": [("none", "none", "float32"), ("int8", "int8", "float32"), ("int4", "int4", "float32"),
              ("int8", "none", "float32"), ("int4", "none", "float32")],
}
PERPLEXITY_TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening to light the lamp. Ships passing the rocky coast "
    "relied on its beam to find the harbour in fog and storms. Over the years he kept a journal of every vessel he "
    "saw, the weather of each night, and the birds that rested on the railing. When the lamp was finally automated, "
    "he donated the journals to the town library, where children still read about the winter the sea froze."
)


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


def float_copy(gguf_path: str) -> str:
    """The GGUF's dequantized weights as a float32 safetensors checkpoint (written once, beside the GGUF)."""
    from pathlib import Path

    from safetensors.torch import save_file

    out = Path(gguf_path).with_suffix(".float32")
    if (out / "model.safetensors").is_file():
        return str(out)
    model = load_transformers_model(gguf_path)
    out.mkdir(parents=True, exist_ok=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    load_tokenizer(gguf_path).save_pretrained(out)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def perplexity(client, ids: torch.Tensor) -> float:
    with torch.inference_mode():
        logits = client(ids).logits[0, :-1].float()
    return float(torch.exp(torch.nn.functional.cross_entropy(logits, ids[0, 1:])))


def accuracy(model_dir: str, n_prompts: int, servers: int, threads: int, kind: str) -> None:
    tokenizer = load_tokenizer(model_dir)
    prompts = [chat_ids(tokenizer, p.text) for p in builtin_prompts()[:n_prompts]]
    local = load_transformers_model(model_dir)
    refs = reference(local, prompts)
    lens = [p.shape[1] for p in prompts]
    text = tokenizer(PERPLEXITY_TEXT, return_tensors="pt")["input_ids"]
    print(f"{model_dir}; perplexity of transformers float32 on the fixed text: {perplexity(local, text):.3f}\n")
    print(f"| servers --quant | client --quant | --wire-dtype | rel. L2 median | max "
          f"| top-1 agree (of {NEW_TOKENS * len(prompts)}) | prompts with all {NEW_TOKENS} | perplexity |")
    print("|---|---|---|---|---|---|---|---|")
    for server_quant in dict.fromkeys(c[0] for c in CONFIGS[kind]):
        with LocalSwarm(model_dir, threads=threads, server_args=["--quant", server_quant]) as swarm:
            swarm.start(even_split(30, servers))
            for sq, client_quant, wire in CONFIGS[kind]:
                if sq != server_quant:
                    continue
                client = DistributedModelForCausalLM.from_pretrained(
                    model_dir, initial_peers=swarm.initial_peers, quant=client_quant, wire_dtype=wire, threads=threads)
                errors, agree = score(client, refs, lens)
                ppl = perplexity(client, text)
                client.close()
                print(f"| {sq} | {client_quant} | {wire} | {statistics.median(errors):.2e} | {max(errors):.2e} | "
                      f"{sum(agree)} | {sum(a == NEW_TOKENS for a in agree)} of {len(agree)} | {ppl:.3f} |",
                      flush=True)


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
    p.add_argument("--float", action="store_true", help="the GGUF's float32 copy under --quant none / int8 / int4")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = str(fetch(args.model)) if args.model == DEFAULT_MODEL else args.model
    if args.speed:
        speed(model_dir, args.prompts, args.servers, args.threads)
    else:
        model_dir = float_copy(model_dir) if args.float else model_dir
        accuracy(model_dir, args.prompts, args.servers, args.threads, "float" if args.float else "gguf")


if __name__ == "__main__":
    main()
