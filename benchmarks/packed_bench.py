"""Packed weights: the kernels side by side, and decoding a GGUF through one server against transformers float32 and
llama.cpp on the same file.

    python benchmarks/packed_bench.py kernels                     # one matrix-vector product per kernel and shape
    python benchmarks/packed_bench.py decode --threads 1,2 --llama-bench PATH/llama-bench [--model FILE.gguf]
    python benchmarks/packed_bench.py decode --threads 1 --depth 1024 --kv-dtypes float32,float16 --llama-bench ...
    python benchmarks/packed_bench.py memory [--model FILE.gguf]      # a server's RSS per block held
    python benchmarks/packed_bench.py session-memory --tokens 2048 --kv-dtypes float32,float16  # RSS of a session
    python benchmarks/packed_bench.py prefill --length 1024 --kv-dtypes float32,float16  # prompt steps, in process
    python benchmarks/packed_bench.py kv-step --depths 128,1024,2048   # a decode step per --kv-dtype, in process
    python benchmarks/packed_bench.py batching --sessions 8            # N generations at once vs one by one
    python benchmarks/packed_bench.py batching --llama-batched-bench PATH/llama-batched-bench  # + llama.cpp's own
    python benchmarks/packed_bench.py span [--model FILE.gguf]         # a server's step: one kernel call vs transformers
    python benchmarks/packed_bench.py amx --rows 1,5,8,16             # a step's products, AMX tiles vs act16
    python benchmarks/packed_bench.py pages [--model FILE.gguf]        # a step, small weights on huge pages or not

`kernels`: median time of y = x W^T for 1 and 8 rows of x, per kernel: torch float32, torch's dynamic int8
(`quantized::linear_dynamic`, activations quantized per call), weight-only int8 (`aten._weight_int8pack_mm`, bf16
activations: its fast case), int4 (`aten._weight_int4pack_mm_for_cpu`, bf16, groups of 32), and swarmlm's packed
Q4_0 / Q4_1 / Q8_0 / Q4_K (activations rounded to int16 per block of 32, integer products: kernels/act16.c). Weights are
cold for every call of the "cold" column (a 64 MiB buffer is written between calls), as they are in a decode step of
a model past the caches.

`decode`: tokens/s of greedy decoding (a chat prompt, 64 new tokens; rounds alternate between the setups so every
setup sees the same machine load): plain transformers float32 in one process, swarmlm client + 1 server (packed,
the file's own blocks) on loopback, and llama.cpp's llama-bench on the same file (`-p 0 -n 64`), per thread count.
`--depth N`: every setup decodes after N cached positions (a prompt of N tokens of plain text; llama-bench `-d N`,
its float16 K/V); `--kv-dtypes float32,float16`: one server per attention-cache dtype (--kv-dtype), side by side.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import time

import torch

from swarmlm.machine import machine_line

SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576), (4096, 4096), (14336, 4096)]  # (out, in)


def _median_s(fn, repeats: int, cold: bool) -> float:
    flush = torch.empty(64 << 20, dtype=torch.uint8)
    fn()
    times = []
    for _ in range(repeats):
        if cold:
            flush.add_(1)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kernel_calls(out_f: int, in_f: int, rows: int) -> dict:
    """name -> a zero-argument call computing x W^T with that kernel (same random weights)."""
    import gguf

    from swarmlm.model.packed import packed_from_numpy

    w = torch.randn(out_f, in_f) * 0.02
    x = torch.randn(rows, in_f)
    calls = {"torch fp32": lambda: x @ w.T}
    dyn = torch.ao.nn.quantized.dynamic.Linear(in_f, out_f, dtype=torch.qint8)
    dyn.set_weight_bias(torch.quantize_per_channel(w, w.abs().amax(1) / 127, torch.zeros(out_f, dtype=torch.long),
                                                   0, torch.qint8), None)
    calls["torch dynamic int8"] = lambda: dyn(x)
    scales = w.abs().amax(1) / 127
    w8 = torch.round(w / scales[:, None]).to(torch.int8)
    xb, sb = x.to(torch.bfloat16), scales.to(torch.bfloat16)
    calls["int8pack (bf16 x)"] = lambda: torch.ops.aten._weight_int8pack_mm(xb, w8, sb)
    try:
        q4 = torch.randint(0, 16, (out_f, in_f), dtype=torch.int32)
        packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 8)
        sz = torch.ones(in_f // 32, out_f, 2, dtype=torch.bfloat16)
        calls["int4pack (bf16 x)"] = lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed4, 32, sz)
    except (RuntimeError, AttributeError):
        pass
    for type_name in ("Q4_0", "Q4_1", "Q8_0"):
        raw = gguf.quantize(w.numpy(), gguf.GGMLQuantizationType[type_name])
        packed = packed_from_numpy(type_name, raw, in_f)
        calls[f"swarmlm {type_name}"] = lambda p=packed: p.matmul(x)
    return calls


def kernels(args) -> None:
    torch.set_num_threads(1)
    print(f"One thread; {machine_line()}. Median of {args.repeats} calls, microseconds, weights cold / hot.\n")
    results = {}
    for rows in (1, 8):
        names = None
        for out_f, in_f in SHAPES:
            calls = kernel_calls(out_f, in_f, rows)
            if names is None:
                names = list(calls)
                print(f"| {rows} row(s): out x in | " + " | ".join(names) + " |")
                print("|---|" + "---|" * len(names))
            cells = []
            for name in names:
                cold = _median_s(calls[name], args.repeats, True) * 1e6
                hot = _median_s(calls[name], args.repeats, False) * 1e6
                results[f"{rows}|{out_f}x{in_f}|{name}"] = (cold, hot)
                cells.append(f"{cold:.0f} / {hot:.0f}")
            print(f"| {out_f} x {in_f} | " + " | ".join(cells) + " |", flush=True)
        print()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine_line(), "kernels_us_cold_hot": results}, f, indent=1)


def model_file(name: str) -> str:
    """--model: the catalog's default model by name (its GGUF, fetched on first use), anything else a path."""
    from swarmlm.model.catalog import DEFAULT_MODEL, fetch

    return str(fetch(name)) if name == DEFAULT_MODEL else name


# ---- decode -----------------------------------------------------------------------------------------------------
def fixed_length(config, tokens: int) -> dict:
    """generate() arguments for exactly `tokens` greedy tokens, as llama-bench decodes: the end-of-sequence id is one
    past the vocabulary (never chosen), so no logits processor runs (min_new_tokens would add two passes over the
    vocabulary per token: ~3 % of a Llama-3.2-1B token here, for transformers and swarmlm alike)."""
    return dict(max_new_tokens=tokens, do_sample=False, eos_token_id=int(config.vocab_size))


def _transformers_tps(model, ids: torch.Tensor, tokens: int) -> float:
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)  # warm
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **fixed_length(model.config, tokens))
        assert out.shape[1] == ids.shape[1] + tokens
        return (tokens - 1) / (time.perf_counter() - t0 - first)


def _swarm_tps(client, ids: torch.Tensor, tokens: int) -> float:
    out = client.generate(ids, attention_mask=torch.ones_like(ids), **fixed_length(client.config, tokens))
    assert out.shape[1] == ids.shape[1] + tokens
    return client.last_stats.tokens_per_s


def _llama_bench_tps(binary: str, model: str, threads: int, tokens: int, depth: int = 0) -> float:
    done = subprocess.run([binary, "-m", model, "-t", str(threads), "-p", "0", "-n", str(tokens), "-d", str(depth),
                           "-r", "1", "-o", "json"], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-400:])
    return float(json.loads(done.stdout)[0]["avg_ts"])


def decode(args) -> None:
    from swarmlm.client.model import DistributedModelForCausalLM
    from swarmlm.model.checkpoint import load_config, load_tokenizer, load_transformers_model
    from swarmlm.swarm.local import LocalSwarm
    from swarmlm.types import BlockRange

    model = model_file(args.model)
    tokenizer = load_tokenizer(model)
    text = "Write a short story about a lighthouse."
    if args.depth:  # N positions of plain text before the first decoded token, as llama-bench's -d N
        story = " ".join(f"The lighthouse keeper wrote entry {i} in the log before the storm came." for i in range(800))
        ids = tokenizer(story, return_tensors="pt")["input_ids"][:, :args.depth]
        assert ids.shape[1] == args.depth, f"the text has only {ids.shape[1]} tokens"
    elif getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    else:  # a preset's random model: no chat template
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
    blocks = int(load_config(model).num_hidden_layers)
    reference = load_transformers_model(model)
    rows = {}
    kv_dtypes = args.kv_dtypes.split(",")
    cpp = "llama.cpp llama-bench, same file (f16 K/V)"
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        setups = {"transformers float32, one process": lambda: _transformers_tps(reference, ids, args.tokens)}
        with contextlib.ExitStack() as stack:
            for kv in kv_dtypes:  # one server per cache dtype, all ready before the first round
                swarm = stack.enter_context(LocalSwarm(model, threads=threads, server_args=[
                    "--quant", args.quant, "--kv-dtype", kv, "--max-length", str(args.depth + args.tokens + 64)]))
                swarm.start([BlockRange(0, blocks)])
                client = DistributedModelForCausalLM.from_pretrained(model, servers=swarm.addresses, quant=args.quant,
                                                                     threads=args.client_threads or threads)
                stack.callback(client.close)
                setups[f"swarmlm client + 1 server (--quant {args.quant}, --kv-dtype {kv})"] = \
                    lambda client=client: _swarm_tps(client, ids, args.tokens)
            if args.llama_bench:
                setups[cpp] = lambda: _llama_bench_tps(args.llama_bench, model, threads, args.tokens, args.depth)
            samples = {name: [] for name in setups}
            for _ in range(args.rounds):  # alternated: every setup sees the same load
                for name, run in setups.items():
                    samples[name].append(run())
        rows[threads] = {name: statistics.median(v) for name, v in samples.items()}
    print(f"{model}: greedy decode, {args.tokens} new tokens after {ids.shape[1]} prompt positions, median of "
          f"{args.rounds} alternated rounds; {machine_line()}\n")
    names = list(next(iter(rows.values())))
    ours = [n for n in names if n.startswith("swarmlm")]
    print("| threads | " + " | ".join(names) + " | " + " | ".join(
        f"{n.split('(')[1].rstrip(')')}: / transformers, / llama.cpp" for n in ours) + " |")
    print("|---|" + "---|" * (len(names) + len(ours)))
    for threads, tps in rows.items():
        ratios = [f"{tps[n] / tps[names[0]]:.2f}x, " + (f"{tps[n] / tps[cpp]:.2f}x" if cpp in tps else "-")
                  for n in ours]
        print(f"| {threads} | " + " | ".join(f"{tps[n]:.1f}" for n in names) + " | " + " | ".join(ratios) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine_line(), "model": model, "tokens_per_s": rows}, f, indent=1)


# ---- memory -----------------------------------------------------------------------------------------------------
def memory(args) -> None:
    """RSS of a ready server holding 1 block and one holding all of them (packed, then dequantized): what the extra
    blocks cost in memory against their bytes in the file."""
    import psutil

    from swarmlm.model.checkpoint import load_config
    from swarmlm.model.gguf import open_gguf
    from swarmlm.swarm.local import LocalSwarm
    from swarmlm.types import BlockRange

    model = model_file(args.model)
    blocks = int(load_config(model).num_hidden_layers)
    checkpoint = open_gguf(model)
    file_bytes = {b: sum(checkpoint.packed_bytes(k) for k in checkpoint.keys() if k.startswith(f"model.layers.{b}."))
                  for b in range(blocks)}
    print(f"{model}; {machine_line()}\n")
    print("| --quant | RSS, 1 block (MiB) | RSS, all blocks (MiB) | difference / the other blocks' file bytes |")
    print("|---|---|---|---|")
    for quant in ("auto", "none"):
        rss = {}
        for span in (BlockRange(0, 1), BlockRange(0, blocks)):
            with LocalSwarm(model, threads=1, with_dht=False, server_args=["--quant", quant]) as swarm:
                swarm.start([span])
                time.sleep(2)
                rss[span.length] = psutil.Process(swarm.servers[0].proc.pid).memory_info().rss
        extra = sum(file_bytes[b] for b in range(1, blocks))
        print(f"| {quant} | {rss[1] / 2**20:.0f} | {rss[blocks] / 2**20:.0f} | "
              f"{(rss[blocks] - rss[1]) / extra:.2f}x ({(rss[blocks] - rss[1]) / 2**20:.0f} MiB for "
              f"{extra / 2**20:.0f} MiB) |", flush=True)


def session_memory(args) -> None:
    """RSS of a packed server of every block, ready, then holding one session of --tokens prompt tokens (its cache
    reserved for them and 8 more), per --kv-dtype: what the session costs against the bytes its reservation counts
    (the memory goal's "plus the KV cache it reserved")."""
    import psutil

    from swarmlm.client.model import DistributedModelForCausalLM
    from swarmlm.model.checkpoint import load_config
    from swarmlm.perf.specs import ModelSpec
    from swarmlm.server.kv_dtype import cache_dtype
    from swarmlm.swarm.local import LocalSwarm
    from swarmlm.types import BlockRange

    torch.set_num_threads(1)
    model = model_file(args.model)
    config = load_config(model)
    blocks = int(config.num_hidden_layers)
    ids = torch.randint(100, 1000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    print(f"{model}; one session of {args.tokens} prompt tokens (reserved for {args.tokens + 8}), one packed server "
          f"of {blocks} blocks; {machine_line()}\n")
    print("| --kv-dtype | RSS ready (MiB) | RSS holding the session (MiB) | difference | reserved (MiB) |")
    print("|---|---|---|---|---|")
    for kv in args.kv_dtypes.split(","):
        with LocalSwarm(model, threads=1, with_dht=False, server_args=[
                "--kv-dtype", kv, "--max-length", str(args.tokens + 8), "--prefix-cache-mb", "0"]) as swarm:
            swarm.start([BlockRange(0, blocks)])
            proc = psutil.Process(swarm.servers[0].proc.pid)
            client = DistributedModelForCausalLM.from_pretrained(model, servers=swarm.addresses, threads=1,
                                                                 prefix_cache=False)
            time.sleep(2)
            ready = proc.memory_info().rss
            with client.inference_session(max_length=args.tokens + 8) as session:
                client.step_logits(session, ids, last_only=True)
                time.sleep(1)
                holding = proc.memory_info().rss
            client.close()
        spec = ModelSpec.from_config(config, l_in_max=0, l_max=args.tokens + 8,  # (as placement prices a session)
                                     cache_bytes_per_value=cache_dtype(kv, torch.float32).itemsize)
        reserved = blocks * spec.cache_bytes_per_session_block
        print(f"| {kv} | {ready / 2**20:.0f} | {holding / 2**20:.0f} | {(holding - ready) / 2**20:.0f} MiB | "
              f"{reserved / 2**20:.0f} |", flush=True)


def prefill(args) -> None:
    """A server's prompt steps in process (transformers' forward: more rows than the one-call decoder takes), per
    --kv-dtype: a prompt of --length tokens in --chunk-token steps, each attending over the cache so far (a float16
    cache is widened to float32 per block per step: the cost measured here); process CPU ms per prompt, medians of
    --rounds alternated rounds."""
    from swarmlm.model.checkpoint import load_config
    from swarmlm.server.stage import Stage
    from swarmlm.types import BlockRange

    torch.set_num_threads(1)
    model = model_file(args.model)
    blocks = BlockRange(0, int(load_config(model).num_hidden_layers))
    stages = {kv: Stage(model, blocks, kv_dtype=kv) for kv in args.kv_dtypes.split(",")}
    hidden = torch.randn(1, args.length, next(iter(stages.values())).hidden_size, generator=torch.Generator().manual_seed(0))
    times = {kv: [] for kv in stages}
    for _ in range(args.rounds):
        for kv, stage in stages.items():
            state = stage.new_state(blocks, 1, args.length)
            t0 = time.process_time()
            for start in range(0, args.length, args.chunk):
                part = hidden[:, start:start + args.chunk]
                stage.step(state, part, torch.ones(1, part.shape[1]))
            times[kv].append(time.process_time() - t0)
    print(f"{model}: a {args.length}-token prompt in steps of {args.chunk}, {blocks.length} blocks, 1 thread, median "
          f"of {args.rounds} alternated rounds, process CPU; {machine_line()}\n")
    print("| --kv-dtype | ms per prompt | tokens/s |")
    print("|---|---|---|")
    for kv, t in times.items():
        print(f"| {kv} | {statistics.median(t) * 1e3:.0f} | {args.length / statistics.median(t):.0f} |")


def kv_step(args) -> None:
    """A server's decode step (the one-call decoder over every block), in process, per --kv-dtype, after a prompt of
    each --depths length: steps alternated between the dtypes (float32, float16, float16, float32, ...) over caches
    of equal length, thread CPU per step, medians."""
    from swarmlm.model.checkpoint import load_config
    from swarmlm.server.stage import Stage
    from swarmlm.types import BlockRange

    torch.set_num_threads(1)
    model = model_file(args.model)
    blocks = BlockRange(0, int(load_config(model).num_hidden_layers))
    stages = {kv: Stage(model, blocks, kv_dtype=kv) for kv in ("float32", "float16")}
    h = stages["float32"].hidden_size
    print(f"{model}: one decode step of {blocks.length} blocks after N positions, 1 thread, {args.steps} steps per "
          f"dtype alternated, thread CPU, medians; {machine_line()}\n")
    print("| positions | float32 K/V (ms) | float16 K/V (ms) | float32 / float16 |")
    print("|---|---|---|---|")
    for depth in [int(d) for d in args.depths.split(",")]:
        prompt = torch.randn(1, depth, h, generator=torch.Generator().manual_seed(0))
        states = {}
        for kv, stage in stages.items():
            states[kv] = stage.new_state(blocks, 1, depth + args.steps + 1)
            stage.step(states[kv], prompt, torch.ones(1, depth))
        times = {kv: [] for kv in stages}
        order = list(stages)
        for i in range(args.steps):
            x = torch.randn(1, 1, h)
            for kv in (order if i % 2 == 0 else order[::-1]):
                t0 = time.thread_time()
                stages[kv].step(states[kv], x, torch.ones(1, 1))
                times[kv].append(time.thread_time() - t0)
        f32, f16 = (statistics.median(times[kv]) * 1e3 for kv in ("float32", "float16"))
        print(f"| {depth} | {f32:.2f} | {f16:.2f} | {f32 / f16:.2f}x |", flush=True)


# ---- span -------------------------------------------------------------------------------------------------------
def span(args) -> None:
    """One server's decode step over all blocks, in process: the one-call decoder (model/decode_span.py) against
    transformers' forward of the same packed blocks, rounds alternated; milliseconds per step, medians."""
    from swarmlm.model.checkpoint import load_config
    from swarmlm.server.stage import Stage
    from swarmlm.types import BlockRange

    torch.set_num_threads(args.threads)
    model = model_file(args.model)
    blocks = BlockRange(0, int(load_config(model).num_hidden_layers))
    fast, plain = Stage(model, blocks), Stage(model, blocks)
    plain._span_decoder = lambda local: None  # transformers' forward, the same packed products
    print(f"{model}: one decode step of {blocks.length} blocks after a 64-token prompt, {args.threads} thread(s), "
          f"median of {args.steps} steps x {args.rounds} alternated rounds; {machine_line()}\n")
    print("| rows | one call (ms) | transformers' forward (ms) | ratio |")
    print("|---|---|---|---|")
    for rows in (1, 8):
        states = {s: s.new_state(blocks, rows, 64 + args.steps * args.rounds + 1) for s in (fast, plain)}
        prompt = torch.randn(rows, 64, fast.hidden_size)
        times = {fast: [], plain: []}
        for stage, state in states.items():
            stage.step(state, prompt, torch.ones(rows, 64))
        for _ in range(args.rounds):
            for stage, state in states.items():
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    stage.step(state, torch.randn(rows, 1, fast.hidden_size), torch.ones(rows, 1))
                    times[stage].append(time.perf_counter() - t0)
        one, other = (statistics.median(times[s]) * 1e3 for s in (fast, plain))
        print(f"| {rows} | {one:.2f} | {other:.2f} | {other / one:.2f}x |", flush=True)


def pages(args) -> None:
    """A server's decode step in process (the one-call decoder), its packed weights smaller than a huge page held in
    the huge-page arena (model/packed.py WeightArena, as a server holds them) or from torch's allocator on small pages
    (as before the arena), steps alternated one by one; spans of every block and of a third of them; ms per step,
    medians."""
    import swarmlm.model.packed as packed
    from swarmlm.model.checkpoint import load_config
    from swarmlm.server.stage import Stage
    from swarmlm.types import BlockRange

    torch.set_num_threads(args.threads)
    model = model_file(args.model)
    total = int(load_config(model).num_hidden_layers)
    print(f"{model}: one decode step (1 row) after a 64-token prompt, {args.threads} thread(s), median of "
          f"{args.steps} steps each, alternated; {machine_line()}\n")
    print("| blocks | huge pages (ms) | small pages (ms) | speed, huge / small |")
    print("|---|---|---|---|")
    for n in (total, max(1, total // 3)):
        blocks = BlockRange(0, n)
        huge = Stage(model, blocks)
        take = packed.SMALL_WEIGHTS.take
        packed.SMALL_WEIGHTS.take = lambda size: torch.empty(size, dtype=torch.uint8)  # (the allocator's pages)
        try:
            small = Stage(model, blocks)
        finally:
            packed.SMALL_WEIGHTS.take = take
        states = {s: s.new_state(blocks, 1, 64 + args.steps + 1) for s in (huge, small)}
        times = {huge: [], small: []}
        for stage, state in states.items():
            stage.step(state, torch.randn(1, 64, huge.hidden_size), torch.ones(1, 64))
        for i in range(args.steps):
            for stage in (huge, small) if i % 2 == 0 else (small, huge):
                x = torch.randn(1, 1, huge.hidden_size)
                t0 = time.perf_counter()
                stage.step(states[stage], x, torch.ones(1, 1))
                times[stage].append(time.perf_counter() - t0)
        a, b = (statistics.median(times[s]) * 1e3 for s in (huge, small))
        print(f"| {n} | {a:.3f} | {b:.3f} | {b / a:.3f}x |", flush=True)
        del huge, small, states


# ---- batching ---------------------------------------------------------------------------------------------------
TOPICS = ["a lighthouse", "the moon", "a river", "bread", "a violin", "winter", "a robot", "the sea", "a garden",
          "trains", "a library", "rain", "mountains", "a cat", "coffee", "a bridge"]


def chat_prompts(tokenizer, n: int) -> list[torch.Tensor]:
    """N chat prompts (a short poem about each of the first N topics) as [1, T] id tensors."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": f"Write a short poem about {t}."}],
                                          add_generation_prompt=True, return_tensors="pt", return_dict=True)
            ["input_ids"] for t in TOPICS[:n]]


def _llama_batched_tps(binary: str, model: str, threads: int, sessions: int, prompt: int, tokens: int) -> list[float]:
    """llama.cpp's own batched decode on the same file (`llama-batched-bench`, built from source): text-generation
    tokens/s of 1 sequence and of `sessions` sequences at once, each after `prompt` prompt tokens, on `threads`."""
    done = subprocess.run([binary, "-m", model, "-c", str(sessions * (prompt + tokens) + 64), "-b", "512", "-ub", "512",
                           "-npp", str(prompt), "-ntg", str(tokens), "-npl", f"1,{sessions}", "-t", str(threads),
                           "--output-format", "jsonl"], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-400:])
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return [float(next(r["speed_tg"] for r in rows if r["pl"] == n)) for n in (1, sessions)]


def batching(args) -> None:
    """Decode tokens/s of N greedy generate() calls one after another vs N at once (N threads of one client, its
    heads batched), through one packed server of every block; the tokens must be the same."""
    import threading

    from swarmlm.client.model import DistributedModelForCausalLM
    from swarmlm.model.checkpoint import load_config, load_tokenizer
    from swarmlm.swarm.local import LocalSwarm
    from swarmlm.types import BlockRange

    torch.set_num_threads(1)
    model = model_file(args.model)
    tokenizer = load_tokenizer(model)
    prompts = chat_prompts(tokenizer, args.sessions)
    blocks = int(load_config(model).num_hidden_layers)
    # the mask given: else generate() infers one from the pad id, and SmolLM2's pad is <|im_end|>, which every chat
    # prompt holds (with the end-of-sequence id past the vocabulary, those prompt tokens would be masked out)
    kwargs = fixed_length(load_config(model), args.tokens)
    with LocalSwarm(model, threads=1, with_dht=False, server_args=["--kv-dtype", args.kv_dtype]) as swarm:
        swarm.start([BlockRange(0, blocks)])
        client = DistributedModelForCausalLM.from_pretrained(model, servers=swarm.addresses, threads=1)
        client.generate(prompts[0], **kwargs)  # warm
        rates = {"one by one": [], f"{args.sessions} at once": []}
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            alone = [client.generate(p, attention_mask=torch.ones_like(p), **kwargs) for p in prompts]
            rates["one by one"].append(len(prompts) * args.tokens / (time.perf_counter() - t0))
            together: list = [None] * len(prompts)

            def run(i: int) -> None:
                together[i] = client.generate(prompts[i], attention_mask=torch.ones_like(prompts[i]), **kwargs)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            rates[f"{args.sessions} at once"].append(len(prompts) * args.tokens / (time.perf_counter() - t0))
            same = sum(torch.equal(a, b) for a, b in zip(alone, together))
        client.close()
    one, many = (statistics.median(v) for v in rates.values())
    print(f"{model}: {args.sessions} chat prompts x {args.tokens} greedy tokens, one packed server of all blocks "
          f"(--kv-dtype {args.kv_dtype}), 1 thread per process, median of {args.rounds} rounds; {machine_line()}\n")
    print(f"| one by one | {args.sessions} at once | ratio | same tokens |")
    print("|---|---|---|---|")
    print(f"| {one:.1f} tok/s | {many:.1f} tok/s | {many / one:.2f}x | {same} of {len(prompts)} |")
    if args.llama_batched_bench:  # the reference: llama.cpp batching the same file on this machine, in one process
        prompt = round(statistics.median(p.shape[1] for p in prompts))
        speeds = {t: [_llama_batched_tps(args.llama_batched_bench, model, t, args.sessions, prompt, args.tokens)
                      for _ in range(args.rounds)] for t in (1, 2)}
        alone, at_once = ({t: statistics.median(run[i] for run in speeds[t]) for t in speeds} for i in (0, 1))
        print(f"\nllama.cpp llama-batched-bench, same file, {prompt}-token prompts, {args.tokens} tokens each, median "
              f"of {args.rounds} runs (text-generation tokens/s):\n")
        print(f"| threads | 1 sequence | {args.sessions} at once | ratio |")
        print("|---|---|---|---|")
        for t in speeds:
            print(f"| {t} | {alone[t]:.1f} | {at_once[t]:.1f} | {at_once[t] / alone[t]:.2f}x |")
        print(f"| {args.sessions} at once on 2 threads / 1 sequence on 1 thread (as above: one by one keeps one CPU "
              f"busy at a time) | | | {at_once[2] / alone[1]:.2f}x |")


# ---- amx --------------------------------------------------------------------------------------------------------
def amx(args) -> None:
    """Every packed product of a server's step over all blocks (each its own weights, read from memory as a server
    reads them), on AMX tiles vs act16's vectors (kernels/amx.c; the same .so, switched, rounds alternated); thread
    CPU time of all products, medians. Where the CPU has no AMX both columns are act16's."""
    from swarmlm.kernels import library
    from swarmlm.model.checkpoint import load_config
    from swarmlm.model.packed import PackedLinear
    from swarmlm.server.stage import Stage
    from swarmlm.types import BlockRange

    torch.set_num_threads(1)
    lib = library()
    model = model_file(args.model)
    stage = Stage(model, BlockRange(0, int(load_config(model).num_hidden_layers)))
    layers = [m for m in stage.modules.modules() if isinstance(m, PackedLinear)]
    print(f"{model}: the {len(layers)} packed products of a step, thread CPU time, median of {args.rounds} alternated "
          f"rounds x 3; AMX here: {bool(lib.packed_amx())}; {machine_line()}\n")
    print("| rows | act16 (ms) | AMX (ms) | ratio |")
    print("|---|---|---|---|")
    with torch.no_grad():  # the weights' pages touched once (the file is mapped) before any arm is timed
        for m in layers:
            m.packed.matmul(torch.zeros(1, m.in_features))
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {n: torch.randn(rows, n) for n in {m.in_features for m in layers}}
        times: dict[int, list[float]] = {0: [], 1: []}
        with torch.no_grad():
            for r in range(args.rounds):
                for on in ((0, 1) if r % 2 else (1, 0)):
                    lib.packed_set_amx(on)
                    for _ in range(3):
                        t0 = time.thread_time()
                        for m in layers:
                            m.packed.matmul(xs[m.in_features])
                        times[on].append(time.thread_time() - t0)
        lib.packed_set_amx(1)
        off, on = (statistics.median(times[k]) * 1e3 for k in (0, 1))
        print(f"| {rows} | {off:.2f} | {on:.2f} | {off / on:.2f}x |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    k = sub.add_parser("kernels")
    k.add_argument("--repeats", type=int, default=30)
    k.add_argument("--out", default="")
    d = sub.add_parser("decode")
    d.add_argument("--model", default="smollm2-135m-instruct")
    d.add_argument("--threads", default="1,2")
    d.add_argument("--tokens", type=int, default=64)
    d.add_argument("--rounds", type=int, default=3)
    d.add_argument("--quant", default="auto")
    d.add_argument("--client-threads", type=int, default=0, help="the client's torch threads (default: --threads)")
    d.add_argument("--llama-bench", default="", help="path of llama.cpp's llama-bench, built from source")
    d.add_argument("--depth", type=int, default=0,
                   help="decode after this many cached positions (a plain-text prompt; llama-bench -d); 0: a chat prompt")
    d.add_argument("--kv-dtypes", default="float32", help="one server per --kv-dtype, e.g. float32,float16")
    d.add_argument("--out", default="")
    m = sub.add_parser("memory")
    m.add_argument("--model", default="smollm2-135m-instruct")
    b = sub.add_parser("batching")
    b.add_argument("--model", default="smollm2-135m-instruct")
    b.add_argument("--sessions", type=int, default=8)
    b.add_argument("--tokens", type=int, default=32)
    b.add_argument("--rounds", type=int, default=3)
    b.add_argument("--kv-dtype", default="auto", help="the server's --kv-dtype")
    b.add_argument("--llama-batched-bench", default="", help="path of llama.cpp's llama-batched-bench (built from "
                   "source): its own batching of the same file beside")
    sm = sub.add_parser("session-memory")
    sm.add_argument("--model", default="smollm2-135m-instruct")
    sm.add_argument("--tokens", type=int, default=2048)
    sm.add_argument("--kv-dtypes", default="float32,float16")
    ks = sub.add_parser("kv-step")
    ks.add_argument("--model", default="smollm2-135m-instruct")
    ks.add_argument("--depths", default="128,1024,2048")
    ks.add_argument("--steps", type=int, default=60)
    pf = sub.add_parser("prefill")
    pf.add_argument("--model", default="smollm2-135m-instruct")
    pf.add_argument("--length", type=int, default=1024)
    pf.add_argument("--chunk", type=int, default=256)
    pf.add_argument("--rounds", type=int, default=3)
    pf.add_argument("--kv-dtypes", default="float32,float16")
    sp = sub.add_parser("span")
    sp.add_argument("--model", default="smollm2-135m-instruct")
    sp.add_argument("--threads", type=int, default=1)
    sp.add_argument("--steps", type=int, default=10)
    sp.add_argument("--rounds", type=int, default=3)
    pg = sub.add_parser("pages")
    pg.add_argument("--model", default="smollm2-135m-instruct")
    pg.add_argument("--threads", type=int, default=1)
    pg.add_argument("--steps", type=int, default=400)
    a = sub.add_parser("amx")
    a.add_argument("--model", default="smollm2-135m-instruct")
    a.add_argument("--rows", default="1,5,8,16")
    a.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    {"kernels": kernels, "decode": decode, "memory": memory, "batching": batching, "span": span,
     "amx": amx, "pages": pages, "session-memory": session_memory, "prefill": prefill,
     "kv-step": kv_step}[args.what](args)


if __name__ == "__main__":
    main()
