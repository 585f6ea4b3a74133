"""The files one decode token runs through, and its hand-overs (calls from a function of one swarmlm file into a
function of another), client and server, on tiny-bloom through one in-process server (no DHT); with --chat also
one whole chat request through the gateway (swarmlm api's app, in process), prompt and one token.

Every thread is traced (sys.setprofile / threading.setprofile) during two greedy generate() calls: one of 1 new
token and one of 1 + N; the difference, over N, is one decode token's share (its prompt and session opening cancel
out). Counts, not times: the same on any machine. Usage:

    .venv/bin/python benchmarks/token_path.py [--tokens 16] [--chat] [--json]
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import tempfile
import threading
from pathlib import Path

import torch

import swarmlm
from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.config import ServerConfig
from swarmlm.model.random_checkpoint import init_checkpoint
from swarmlm.server.server import Server
from swarmlm.types import BlockRange

ROOT = str(Path(swarmlm.__file__).parent) + "/"


class Tracer:
    """Per swarmlm file: functions entered; per (caller file, callee file): calls across files."""

    def __init__(self) -> None:
        self.on = False
        self.entered: collections.Counter[str] = collections.Counter()
        self.handovers: collections.Counter[tuple[str, str]] = collections.Counter()

    def __call__(self, frame, event, arg) -> None:
        if not self.on or event != "call":
            return
        callee = frame.f_code.co_filename
        if not callee.startswith(ROOT):
            return
        callee = callee[len(ROOT):]
        self.entered[callee] += 1
        caller = frame.f_back
        while caller is not None and not caller.f_code.co_filename.startswith(ROOT):
            caller = caller.f_back  # through torch, grpc, asyncio...: the last swarmlm frame handed it over
        if caller is not None and caller.f_code.co_filename[len(ROOT):] != callee:
            self.handovers[(caller.f_code.co_filename[len(ROOT):], callee)] += 1

    def run(self, fn):
        self.entered.clear(), self.handovers.clear()
        self.on = True
        try:
            fn()
        finally:
            self.on = False
        return collections.Counter(self.entered), collections.Counter(self.handovers)


def _chat_request(tracer: Tracer, client, model_dir: str, tokens: int):
    """/v1/chat/completions through the gateway's app (warmed by one first): one of one token, one of 1 + `tokens`
    (the second may end early at an eos: the tokens it made count)."""
    from fastapi.testclient import TestClient

    from swarmlm.api.app import create_app
    from swarmlm.api.config import GatewayConfig
    from swarmlm.model.checkpoint import load_tokenizer

    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 1,
            "temperature": 0}
    app = create_app(client, load_tokenizer(model_dir), GatewayConfig(model_name="tiny"))
    with TestClient(app, base_url="http://127.0.0.1") as http:
        warm = http.post("/v1/chat/completions", json=body)
        assert warm.status_code == 200, warm.text
        one = tracer.run(lambda: http.post("/v1/chat/completions", json=body).raise_for_status())
        longer = {**body, "max_tokens": 1 + tokens}
        reply: list = []
        more = tracer.run(lambda: reply.append(http.post("/v1/chat/completions", json=longer).json()))
        made = reply[0]["usage"]["completion_tokens"]
        return one, more, made - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--chat", action="store_true", help="also one chat request through the gateway")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    tracer = Tracer()
    sys.setprofile(tracer)
    threading.setprofile(tracer)  # threads started from here on: the server's loop, its compute thread, gRPC's
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(init_checkpoint("tiny-bloom", tmp, seed=1))
        blocks = BlockRange(0, int(json.loads((Path(model_dir) / "config.json").read_text())["n_layer"]))
        server = Server(ServerConfig(model_dir=model_dir, blocks=blocks, drain_timeout_s=0.0))
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(timeout=180)
        client = DistributedModelForCausalLM.from_pretrained(model_dir, servers=[server.address])
        try:
            ids = torch.tensor([[5, 17, 42, 7, 99, 3]])
            client.generate(ids, max_new_tokens=4, do_sample=False)  # warm: routes, channels, profiles
            short = tracer.run(lambda: client.generate(ids, max_new_tokens=1, do_sample=False))
            long = tracer.run(lambda: client.generate(ids, max_new_tokens=1 + args.tokens, do_sample=False))
            chat = _chat_request(tracer, client, model_dir, args.tokens) if args.chat else None
        finally:
            client.close()
            asyncio.run_coroutine_threadsafe(server.stop(), loop).result(timeout=60)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
    files = {f: (long[0][f] - short[0][f]) / args.tokens for f in long[0] if long[0][f] > short[0][f]}
    pairs = {p: (long[1][p] - short[1][p]) / args.tokens for p in long[1] if long[1][p] > short[1][p]}
    result = {"files": len(files), "handovers_per_token": round(sum(pairs.values()), 1),
              "calls_per_token": round(sum(files.values()), 1),
              "per_file_calls": dict(sorted(files.items(), key=lambda kv: -kv[1])),
              "per_pair_handovers": {f"{a} -> {b}": n for (a, b), n in sorted(pairs.items(), key=lambda kv: -kv[1])}}
    if chat is not None:
        (entered, handed), (entered_more, handed_more), extra = chat
        result["chat_request"] = {"files": len(entered), "handovers": sum(handed.values()),
                                  "calls": sum(entered.values()), "per_file_calls": dict(sorted(entered.items()))}
        if extra > 0:  # the gateway's decode token: the difference, per extra token
            result["chat_decode_token"] = {
                "files": sum(1 for f in entered_more if entered_more[f] > entered[f]),
                "handovers": round((sum(handed_more.values()) - sum(handed.values())) / extra, 1)}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    if chat is not None:
        print(f"one chat request (prompt + 1 token) through the gateway: {result['chat_request']['files']} swarmlm "
              f"files, {result['chat_request']['handovers']} hand-overs, {result['chat_request']['calls']} calls")
        if "chat_decode_token" in result:
            print(f"one decode token of a chat request: {result['chat_decode_token']['files']} files, "
                  f"{result['chat_decode_token']['handovers']} hand-overs")
    print(f"one decode token through one server: {result['files']} swarmlm files, "
          f"{result['handovers_per_token']} hand-overs (calls across files), {result['calls_per_token']} calls")
    for name, n in result["per_file_calls"].items():
        print(f"  {n:7.1f}  {name}")


if __name__ == "__main__":
    main()
