"""Decode-path accuracy of packed weights on a trained model: a GGUF's blocks and head as swarmlm keeps them (packed,
the kernels' activation rounding included) against the same file dequantized to float32, token by token.

trained_accuracy.py scores a whole sequence in one pass (a prefill of more than DIRECT_ROWS rows: dequantized
weights and torch's GEMM, exact); this one runs what a decode step runs -- one token at a time through the packed
kernels (`model/packed.py`, `kernels/act16.c` for Q4_0 / Q4_1 / Q8_0) -- on the tokens the float32 reference
chooses greedily (teacher forced: both score the same positions). Per prompt: relative L2 error of the logits,
||packed - float32|| / ||float32|| over every position, and how many positions keep the reference's argmax.

    python benchmarks/decode_accuracy.py --prompts 32 --steps 31    # SmolLM2-135M-Instruct's Q4_1 file (catalog)
    python benchmarks/decode_accuracy.py --kv-dtypes float32,float16  # packed servers' caches in each (--kv-dtype)
"""
from __future__ import annotations

import argparse
import statistics

import torch

from swarmlm.bench.workload import builtin_prompts
from swarmlm.machine import machine_line
from swarmlm.model.catalog import DEFAULT_MODEL, fetch
from swarmlm.model.checkpoint import load_client_modules, load_config, load_tokenizer
from swarmlm.server.stage import Stage
from swarmlm.types import BlockRange


def decode_logits(stage: Stage, client, ids: torch.Tensor, forced: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """The prompt, then `steps` tokens one at a time: `forced` ones, or (forced empty) the greedy choices, which are
    returned. Logits [steps + 1, vocab] of every position that predicts a next token."""
    blocks = BlockRange(0, stage.blocks.end)
    state = stage.new_state(blocks, 1, ids.shape[1] + steps + 1)
    hidden = stage.step(state, client.embed(ids), torch.ones(1, ids.shape[1]))
    logits = [client.lm_head(client.final_norm(hidden[:, -1:]))[0, -1]]
    chosen = list(forced)
    for i in range(steps):
        if not forced:
            chosen.append(int(logits[-1].argmax()))
        hidden = stage.step(state, client.embed(torch.tensor([[chosen[i]]])), torch.ones(1, 1))
        logits.append(client.lm_head(client.final_norm(hidden))[0, -1])
    return torch.stack(logits), chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file (default: the catalog's default model)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--steps", type=int, default=31, help="decode steps after each prompt")
    parser.add_argument("--kv-dtypes", default="float32",
                        help="the packed stage's attention caches, one row each (the reference's stay float32)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = args.model or fetch(DEFAULT_MODEL)
    blocks = BlockRange(0, load_config(model).num_hidden_layers)
    reference = Stage(model, blocks, quant="none", kv_dtype="float32")
    packed = {kv: Stage(model, blocks, quant="auto", kv_dtype=kv) for kv in args.kv_dtypes.split(",")}
    reference_client, packed_client = load_client_modules(model, quant="none")[2], load_client_modules(model)[2]
    tokenizer = load_tokenizer(model)
    errors, kept, positions = {kv: [] for kv in packed}, dict.fromkeys(packed, 0), 0
    with torch.inference_mode():
        for prompt in builtin_prompts()[:args.prompts]:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)["input_ids"]
            want, tokens = decode_logits(reference, reference_client, ids, [], args.steps)
            for kv, stage in packed.items():
                got, _ = decode_logits(stage, packed_client, ids, tokens, args.steps)
                errors[kv].append(float((got - want).norm() / want.norm()))
                kept[kv] += int((got.argmax(-1) == want.argmax(-1)).sum())
            positions += want.shape[0]
    print(machine_line())
    for kv, stage in packed.items():
        print(f"{model}: blocks {stage.packed_types}, --kv-dtype {kv}, packed vs dequantized float32 (float32 cache), "
              f"{len(errors[kv])} prompts x {args.steps + 1} positions: logits error median "
              f"{statistics.median(errors[kv]):.3%} max {max(errors[kv]):.3%}; greedy choice kept "
              f"{kept[kv]}/{positions} ({kept[kv] / positions:.1%})")


if __name__ == "__main__":
    main()
