"""The client's CPU per token: what a decode step costs the client process besides the servers' compute.

    python benchmarks/client_cpu.py [--sessions 8] [--tokens 32] [--rounds 3] [--model FILE.gguf]

One packed server of every block (SmolLM2 Q4_1 by default) on loopback, one thread per process, as
`packed_bench.py batching` runs it: N chat prompts generated one by one, then the same N at once (N threads of one
client, heads batched), the tokens compared. Per mode, median over the rounds:
- the client process's CPU time (`time.process_time`: every thread, the loop thread too) per generated token;
- the thread CPU (`time.thread_time`) inside the parts of a step, per generated token (the prefill's share
  included): `generate` (transformers' loop and all below it), `forward` (DistributedModelForCausalLM.forward),
  `embed`, `session.step` (mask, route, request, encode, MAC, frame, the wait's syscalls, reply check, decode),
  `head` (HeadBatcher.__call__: the batch's wait and hand-off, final norm and LM head), `head matmul` (the packed
  product alone). A part's time includes the parts it calls.
Thread CPU, not wall time: on a shared machine the parts' CPU moves less with load than the wall clock does.
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections import Counter
from contextlib import contextmanager

import torch

from packed_bench import chat_prompts, fixed_length, model_file  # (benchmarks/, this script's directory)
from swarmlm.machine import machine_line

PARTS = ("generate", "forward", "embed", "session.step", "head", "head matmul")


@contextmanager
def part_clocks(parts: Counter):
    """Wrap each part's function (class attribute) so its thread CPU adds up in `parts` (seconds); undone after."""
    from swarmlm.client.head_batcher import HeadBatcher
    from swarmlm.client.model import DistributedModelForCausalLM
    from swarmlm.client.session import InferenceSession
    from swarmlm.model.packed import PackedTensor

    targets = {"generate": (DistributedModelForCausalLM, "generate"),
               "forward": (DistributedModelForCausalLM, "forward"),
               "embed": (DistributedModelForCausalLM, "embed"), "session.step": (InferenceSession, "step"),
               "head": (HeadBatcher, "__call__"), "head matmul": (PackedTensor, "matmul")}
    saved = {name: getattr(owner, attr) for name, (owner, attr) in targets.items()}

    def clocked(name, fn):
        def run(*args, **kwargs):
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                parts[name] += time.thread_time() - t0
        return run

    for name, (owner, attr) in targets.items():
        setattr(owner, attr, clocked(name, saved[name]))
    try:
        yield parts
    finally:
        for name, (owner, attr) in targets.items():
            setattr(owner, attr, saved[name])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    from swarmlm.client.model import DistributedModelForCausalLM
    from swarmlm.model.checkpoint import load_config, load_tokenizer
    from swarmlm.swarm.local import LocalSwarm
    from swarmlm.types import BlockRange

    torch.set_num_threads(1)
    model = model_file(args.model)
    tokenizer = load_tokenizer(model)
    prompts = chat_prompts(tokenizer, args.sessions)  # packed_bench.py batching's prompts and generate() arguments
    config = load_config(model)
    kwargs = fixed_length(config, args.tokens)
    n_tokens = len(prompts) * args.tokens
    modes = ("one by one", f"{len(prompts)} at once")
    process_ms = {m: [] for m in modes}
    part_ms = {m: {name: [] for name in PARTS} for m in modes}
    same = 0
    with LocalSwarm(model, threads=1, with_dht=False) as swarm:
        swarm.start([BlockRange(0, int(config.num_hidden_layers))])
        client = DistributedModelForCausalLM.from_pretrained(model, servers=swarm.addresses, threads=1)

        def generate(i: int) -> torch.Tensor:
            return client.generate(prompts[i], attention_mask=torch.ones_like(prompts[i]), **kwargs)

        generate(0)  # warm
        for _ in range(args.rounds):
            for mode in modes:
                parts: Counter = Counter()
                with part_clocks(parts):
                    c0 = time.process_time()
                    if mode == modes[0]:
                        alone = [generate(i) for i in range(len(prompts))]
                    else:
                        together: list = [None] * len(prompts)
                        threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, generate(i)))
                                   for i in range(len(prompts))]
                        for t in threads:
                            t.start()
                        for t in threads:
                            t.join()
                    process_ms[mode].append((time.process_time() - c0) / n_tokens * 1e3)
                for name in PARTS:
                    part_ms[mode][name].append(parts[name] / n_tokens * 1e3)
            same = sum(torch.equal(a, b) for a, b in zip(alone, together))
        client.close()
    print(f"{model}: {len(prompts)} chat prompts x {args.tokens} greedy tokens, one packed server of all blocks, "
          f"1 thread per process; client CPU per generated token (ms), median of {args.rounds} rounds; "
          f"{machine_line()}\n")
    print("| mode | client process | " + " | ".join(PARTS) + " | same tokens |")
    print("|---|---|" + "---|" * len(PARTS) + "---|")
    for mode in modes:
        cells = [f"{statistics.median(part_ms[mode][name]):.3f}" for name in PARTS]
        print(f"| {mode} | {statistics.median(process_ms[mode]):.3f} | " + " | ".join(cells)
              + f" | {same} of {len(prompts)} |")


if __name__ == "__main__":
    main()
