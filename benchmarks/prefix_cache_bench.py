"""Prompt caches that outlive a session (issue 25): chat requests through `swarmlm api`, cache on vs off, side by side.

One swarm (servers with the prefix cache on, and a DHT on loopback), two gateways on it: `on` (the default) and `off` (--no-prefix-cache:
every prompt prefilled in full). Conversations of 3 turns share one ~400-token system prompt; each request is
sent to both gateways in turn (alternating who goes first), one at a time, streaming. Per request: time to the
first streamed token, and the prompt tokens the servers computed (their `tokens_computed` counters, minus the
decode steps), from which the hidden-state bytes of the prefill on the wire follow (float32: tokens x
hidden x 4 bytes, there and back, per server; both gateways send float32). Last, `--lone` requests with system
prompts of their own (each different) share nothing: what the cache costs when it cannot help.

`--network wan` (or lan, or a topology file) puts each server on an emulated host of the netem testbed (as
swarmlm/bench does; no DHT then: the gateways get the servers' addresses); the gateways and this script stay on the
client's side of the emulated links.

    python benchmarks/prefix_cache_bench.py [--preset bloomz-560m] [--servers 2] [--conversations 3] [--lone 3]
        [--network loopback|lan|wan|TOPOLOGY.yaml] [--netem-mode auto]
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
from swarmlm.bench.runner import BenchConfig, StrategyConfig, start_swarm
from swarmlm.machine import machine_info
from swarmlm.model.checkpoint import load_config
from swarmlm.model.random_checkpoint import default_checkpoint
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire import swarm_pb2_grpc as pb_grpc
from swarmlm.wire.channel import sync_channel

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


def computed(stubs: list) -> int:
    return sum(s.Info(pb.InfoRequest(), timeout=60).tokens_computed for s in stubs)


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


def request(client, url, model, messages, max_tokens, stubs) -> dict:
    before = computed(stubs)
    ttft, text, tokens, reason = chat(client, url, model, messages, max_tokens)
    decode = tokens if reason == "stop" else tokens - 1  # generated tokens fed back (an end-of-text is not)
    prefill = (computed(stubs) - before - decode * len(stubs)) / len(stubs)
    return {"ttft_s": ttft, "text": text, "prefill_tokens_per_server": prefill}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bloomz-560m")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--lone", type=int, default=3, help="requests that share nothing (each its own system prompt)")
    ap.add_argument("--system-tokens", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--network", default="loopback", help="loopback, lan, wan or a topology file (netem testbed)")
    ap.add_argument("--netem-mode", default="auto", choices=("auto", "namespaces", "relay-only"))
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = str(default_checkpoint(args.preset))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = load_config(model_dir)
    cfg = BenchConfig(model_dir=model_dir, servers=(args.servers,), strategies=(StrategyConfig("sequential"),),
                      network=args.network, netem_mode=args.netem_mode)
    with start_swarm(cfg, args.servers, int(config.num_hidden_layers)) as swarm:
        rows = run(args, model_dir, tokenizer, swarm)
    report(rows, args, int(config.hidden_size))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "args": vars(args), "network_info": swarm.network_info,
                       "rows": rows}, f, indent=1)


def gateways_for(model_dir: str, swarm) -> dict[str, GatewayProcess]:
    where = ["--servers", *swarm.server_addresses] if swarm.server_addresses else []
    common = [*where, "--wire-dtype", "float32"]  # the same bytes on and off, whatever the link
    return {"on": GatewayProcess(model_dir, swarm.initial_peers, extra=common),
            "off": GatewayProcess(model_dir, swarm.initial_peers, extra=[*common, "--no-prefix-cache"])}


def run(args, model_dir: str, tokenizer, swarm) -> list[dict]:
    """Conversations sharing one system prompt, then requests sharing nothing; each sent to both gateways."""
    addresses = swarm.server_addresses or [t.address for t in swarm.tracked if t.address]
    stubs = [pb_grpc.SwarmStub(sync_channel(a)) for a in addresses]
    system = system_prompt(tokenizer, args.system_tokens)
    gateways = gateways_for(model_dir, swarm)
    rows: list[dict] = []
    clients = {name: httpx.Client() for name in gateways}

    def send(name: str, messages: list[dict], **where) -> str:
        r = request(clients[name], gateways[name].url, model_dir, messages, args.max_tokens, stubs)
        rows.append({"mode": name, **where, **{k: v for k, v in r.items() if k != "text"}})
        print(json.dumps(rows[-1]), flush=True)
        return r["text"]

    try:
        for g in gateways.values():
            g.start()
        for name, g in gateways.items():  # warm-up: connections, first-call costs (shares nothing)
            request(clients[name], g.url, model_dir, [{"role": "user", "content": f"hello {name}"}], 2, stubs)
        for c in range(args.conversations):
            history = {name: [{"role": "system", "content": system}] for name in gateways}
            for turn in range(3):
                for name in order(gateways, c + turn):
                    history[name].append({"role": "user", "content": USERS[(3 * c + turn) % len(USERS)]})
                    text = send(name, history[name], conversation=c, turn=turn)
                    history[name].append({"role": "assistant", "content": text})
        for k in range(args.lone):  # salts 3, 4, ...: system prompts unlike the shared one and each other
            lone = [{"role": "system", "content": system_prompt(tokenizer, args.system_tokens, salt=3 + k)},
                    {"role": "user", "content": f"Nothing shared here ({k})."}]
            for name in order(gateways, k):
                send(name, lone, conversation=-1, turn=k)
    finally:
        for g in gateways.values():
            g.stop()
        for c in clients.values():
            c.close()
    return rows


def order(gateways: dict, i: int) -> list[str]:
    """Who goes first alternates, so neither gateway always follows the other's request."""
    return list(gateways) if i % 2 == 0 else list(gateways)[::-1]


def report(rows: list[dict], args, hidden: int) -> None:
    groups = {"first request (cold)": lambda r: r["conversation"] == 0 and r["turn"] == 0,
              "turn 1, system prompt seen": lambda r: r["conversation"] > 0 and r["turn"] == 0,
              "turns 2-3": lambda r: r["conversation"] >= 0 and r["turn"] > 0,
              "shares nothing": lambda r: r["conversation"] == -1}
    print(f"\n{args.preset}, {args.servers} servers, {args.network}, ~{args.system_tokens}-token system prompt, "
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
    lone = {m: [r["ttft_s"] for r in rows if r["mode"] == m and r["conversation"] == -1] for m in ("on", "off")}
    if lone["on"]:  # each pair sent back to back: its ratio is less exposed to the machine's drift
        pairs = [a / b for a, b in zip(lone["on"], lone["off"])]
        print(f"shares nothing, on/off per pair: {' '.join(f'{x:.2f}' for x in pairs)}, "
              f"median {statistics.median(pairs):.2f}")


if __name__ == "__main__":
    main()
