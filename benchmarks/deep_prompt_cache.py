"""A deep prompt with the servers' caches vs without them (each new token one stateless pass over the sequence, how
deep prompts generated before issue 37): two server processes of a random small-bloom (8 blocks, hidden 512),
greedy tokens, fp32. Prints one JSON line per mode; the tokens of both must be equal.

    nice -n 10 .venv/bin/python benchmarks/deep_prompt_cache.py [--new-tokens 64] [--prompt-tokens 16]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from swarmlm.client.model import DistributedModelForCausalLM  # noqa: E402
from swarmlm.machine import machine_info  # noqa: E402
from swarmlm.model.random_checkpoint import init_checkpoint  # noqa: E402
from swarmlm.swarm.local import LocalSwarm  # noqa: E402
from swarmlm.types import BlockRange  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=16, help="K, the deep prompt's length")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(Path(tmp) / "small-bloom")
        init_checkpoint("small-bloom", model_dir)
        with LocalSwarm(model_dir, threads=1, with_dht=False) as swarm:
            for blocks in (BlockRange(0, 4), BlockRange(4, 8)):
                swarm.start_server(blocks)
            model = DistributedModelForCausalLM.from_pretrained(
                model_dir, servers=swarm.addresses, dtype="float32", tuning_mode="deep_ptune",
                pre_seq_len=args.prompt_tokens)
            with torch.no_grad():
                model.prompts.deep_prompts.normal_(0, 1.0, generator=torch.Generator().manual_seed(0))
            ids = torch.randint(0, 1024, (1, 12), generator=torch.Generator().manual_seed(1))
            out = {}
            for cached in (True, False):
                model.generate(ids, max_new_tokens=2, do_sample=False, use_cache=cached)  # warm-up
                t0 = time.perf_counter()
                tokens = model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                        do_sample=False, use_cache=cached)[0, ids.shape[1]:].tolist()
                wall = time.perf_counter() - t0
                out[cached] = tokens
                print(json.dumps({"use_cache": cached, "new_tokens": len(tokens), "wall_s": round(wall, 2),
                                  "tokens_per_s": round(len(tokens) / wall, 1)}), flush=True)
            model.close()
    print(json.dumps({"same_tokens": out[True] == out[False], "machine": machine_info()}))


if __name__ == "__main__":
    main()
