"""Prompt caches that outlive a session (issue 25): chat requests through `swarmlm api`, cache on vs off, side by side.

One swarm (DHT + servers, prefix cache on), two gateways on it: `on` (the default) and `off` (--no-prefix-cache:
every prompt prefilled in full). Conversations of 3 turns share one ~400-token system prompt; each request is
sent to both gateways in turn (alternating who goes first), one at a time, streaming. Per request: time to the
first streamed token, and the prompt tokens the servers computed (their `tokens_computed` counters, minus the
decode steps), from which the hidden-state bytes of the prefill on the wire follow (float32 on loopback: tokens x
hidden x 4 bytes, there and back, per server). A last request with a system prompt of its own shares nothing.

    python benchmarks/prefix_cache_bench.py [--preset bloomz-560m] [--servers 2] [--conversations 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx2 as httpx
import torch
from transformers import AutoTokenizer

from swarmlm.api.process import GatewayProcess
from swarmlm.machine import machine_info
from swarmlm.model.checkpoint import load_config
from swarmlm.model.random_checkpoint import default_checkpoint
from swarmlm.swarm.local import LocalSwarm, even_split
from swarmlm.wire import swarm_pb2 as pb
from tests.swarm_helpers import stub

WORDS = ("the library keeps maps atlases letters and records of the city; readers ask the staff at the desk, "
         "borrow up to five books for three weeks, and return them to the box by the door").split()
USERS = ["Where are the atlases kept?", "Can I borrow a map for a week?", "Who answers questions about letters?",
         "Is the reading room quiet?", "What happens if a book is late?", "Do you keep old newspapers?",
         "How many books may I take?", "Where is the return box?", "Can children get a card?"]


def system_prompt(tokenizer, tokens: int, salt: int = 0) -> str:
    words = [WORDS[(i * 7 + salt) % len(WORDS)] for i in range(tokens)]
    while len(tokenizer(" ".join(words)).input_ids) > tokens:
        words.pop()
    return "You are the library's assistant. " + " ".join(words)


def computed(swarm) -> int:
    return sum(stub(s.address).Info(pb.InfoRequest()).tokens_computed for s in swarm.servers)


def chat(client: httpx.Client, url: str, model: str, messages: list[dict],
         max_tokens: int) -> tuple[float, str, int, str]:
    """(TTFT s, text, streamed tokens, finish reason) of one streaming chat request."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0, ttft, parts, reason = time.perf_counter(), 0.0, [], ""
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            if choice.get("delta", {}).get("content") is not None and choice.get("finish_reason") is None:
                ttft = ttft or time.perf_counter() - t0
                parts.append(choice["delta"]["content"])
            reason = choice.get("finish_reason") or reason
    return ttft, "".join(parts), len(parts), reason


def request(client, url, model, messages, max_tokens, swarm) -> dict:
    before = computed(swarm)
    ttft, text, tokens, reason = chat(client, url, model, messages, max_tokens)
    decode = tokens if reason == "stop" else tokens - 1  # generated tokens fed back (an end-of-text is not)
    prefill = (computed(swarm) - before - decode * len(swarm.servers)) / len(swarm.servers)
    return {"ttft_s": ttft, "text": text, "prefill_tokens_per_server": prefill}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bloomz-560m")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = str(default_checkpoint(args.preset))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hidden = int(load_config(model_dir).hidden_size)
    system = system_prompt(tokenizer, args.system_tokens)
    rows: list[dict] = []
    with LocalSwarm(model_dir) as swarm:
        swarm.start(even_split(int(load_config(model_dir).num_hidden_layers), args.servers))
        gateways = {"on": GatewayProcess(model_dir, swarm.initial_peers),
                    "off": GatewayProcess(model_dir, swarm.initial_peers, extra=["--no-prefix-cache"])}
        try:
            for g in gateways.values():
                g.start()
            clients = {name: httpx.Client() for name in gateways}
            for name, g in gateways.items():  # warm-up: connections, first-call costs (shares nothing)
                request(clients[name], g.url, model_dir, [{"role": "user", "content": f"hello {name}"}], 2, swarm)
            for c in range(args.conversations):
                history = {name: [{"role": "system", "content": system}] for name in gateways}
                for turn in range(3):
                    order = list(gateways) if (c + turn) % 2 == 0 else list(gateways)[::-1]
                    for name in order:
                        history[name].append({"role": "user", "content": USERS[(3 * c + turn) % len(USERS)]})
                        r = request(clients[name], gateways[name].url, model_dir, history[name], args.max_tokens,
                                    swarm)
                        history[name].append({"role": "assistant", "content": r.pop("text")})
                        rows.append({"mode": name, "conversation": c, "turn": turn, **r})
                        print(json.dumps(rows[-1]), flush=True)
            lone = [{"role": "system", "content": system_prompt(tokenizer, args.system_tokens, salt=3)},
                    {"role": "user", "content": "Nothing shared here."}]
            for name in gateways:
                r = request(clients[name], gateways[name].url, model_dir, lone, args.max_tokens, swarm)
                r.pop("text")
                rows.append({"mode": name, "conversation": -1, "turn": 0, **r})
                print(json.dumps(rows[-1]), flush=True)
        finally:
            for g in gateways.values():
                g.stop()
    report(rows, args, hidden)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "args": vars(args), "rows": rows}, f, indent=1)


def report(rows: list[dict], args, hidden: int) -> None:
    groups = {"first request (cold)": lambda r: r["conversation"] == 0 and r["turn"] == 0,
              "turn 1, system prompt seen": lambda r: r["conversation"] > 0 and r["turn"] == 0,
              "turns 2-3": lambda r: r["turn"] > 0,
              "shares nothing": lambda r: r["conversation"] == -1}
    print(f"\n{args.preset}, {args.servers} servers, loopback, ~{args.system_tokens}-token system prompt, "
          f"{args.conversations} conversations x 3 turns, medians")
    print("| requests | n | TTFT on (ms) | TTFT off (ms) | on/off | prefill tokens/server on / off | "
          "prefill MB on the wire on / off |")
    print("|---|---|---|---|---|---|---|")
    for label, pick in groups.items():
        on = [r for r in rows if r["mode"] == "on" and pick(r)]
        off = [r for r in rows if r["mode"] == "off" and pick(r)]
        if not on or not off:
            continue
        med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
        mb = lambda t: t * hidden * 4 * 2 * args.servers / 1e6  # noqa: E731  (there and back, every server)
        t_on, t_off = med(on, "ttft_s"), med(off, "ttft_s")
        p_on, p_off = med(on, "prefill_tokens_per_server"), med(off, "prefill_tokens_per_server")
        print(f"| {label} | {len(on)} | {t_on * 1000:.0f} | {t_off * 1000:.0f} | {t_on / t_off:.2f} | "
              f"{p_on:.0f} / {p_off:.0f} | {mb(p_on):.2f} / {mb(p_off):.2f} |")


if __name__ == "__main__":
    main()
