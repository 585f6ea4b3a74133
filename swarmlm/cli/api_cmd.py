"""`swarmlm api --model NAME_OR_DIR --initial-peers ADDR [--adapter DIR|NAME ...] [--host H] [--port P] [--api-key K]`:
an OpenAI-compatible HTTP gateway to the swarm (the base model and each tuned model under its own id), with a live
monitor page at `/` (docs/API.md)."""
from __future__ import annotations

import argparse
import json
import sys

from swarmlm.cli.args import add_client_precision, add_dtype, add_push, add_speculative, add_swarm_key
from swarmlm.config import usable_cores

# --help lists these first ("common options"), the rest under "advanced options"
COMMON = ("--model", "--initial-peers", "--servers", "--adapter", "--served-model-name", "--host", "--port",
          "--api-key")


def add_parser(sub) -> None:
    p = sub.add_parser("api", help="serve the swarm's model over OpenAI's HTTP API, with a monitor page")
    p.add_argument("--model", required=True,
                   help="checkpoint directory or model id (the client loads embeddings + head)")
    p.add_argument("--adapter", action="append", default=[], metavar="DIR|NAME",
                   help="also serve a tuned model under its own id (repeatable): a folder saved by save_adapter (a "
                        "soft prompt runs here; a LoRA on the servers that pre-load it with --adapters), or the name "
                        "of an adapter servers pre-load; its id is its folder's name (the folder as given is accepted "
                        "too)")
    p.add_argument("--served-model-name", metavar="ID",
                   help="the base model's id clients send and responses carry (default: a catalog name or hub id as "
                        "given, a directory or GGUF file by its own name, never its path; --model as given is "
                        "accepted too)")
    p.add_argument("--initial-peers", nargs="*", default=[], metavar="ADDR",
                   help="DHT multiaddrs (printed by `swarmlm dht`)")
    p.add_argument("--servers", nargs="*", default=[], help="direct host:port list instead of a DHT")
    p.add_argument("--host", default="127.0.0.1",
                   help="the interface to listen on (0.0.0.0: every interface; set --api-key then)")
    p.add_argument("--port", type=int, default=8000, help="0 = any free port (printed in the ready line)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--max-streams-per-client", type=int, default=32,
                   help="concurrent choices (sessions) per API key, or per client IP without one; more get 429")
    p.add_argument("--max-choices-per-request", type=int, default=16, help="prompts x n of one request")
    p.add_argument("--max-prompt-chars", type=int, default=262_144,
                   help="characters of a request's prompts or messages (checked before tokenizing)")
    p.add_argument("--max-body-bytes", type=int, default=2 << 20, help="larger request bodies get 413")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may generate before it ends with 504")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection has to send a request's headers before it is closed")
    p.add_argument("--body-timeout", type=float, default=30.0, help="seconds a request's body has to arrive (408)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="also answer requests whose Host header names NAME (repeatable; '*' = any). Default: "
                        "localhost, 127.0.0.1, ::1 and --host when it is one address")
    p.add_argument("--wait-for-blocks", type=float, default=30.0,
                   help="seconds a request waits for missing blocks to appear before a 503")
    p.add_argument("--wait-for-loading", type=float, default=300.0,
                   help="seconds in all a request waits while servers announce every missing block as loading")
    p.add_argument("--threads", type=int, default=usable_cores(),
                   help="torch threads for the embeddings and LM head (default: the cores this process may use, "
                        "here %(default)s)")
    add_dtype(p, "the embeddings and LM head")
    p.add_argument("--log-level", default="warning", help="log verbosity (uvicorn's and swarmlm's)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every prompt in full (default: start from prefixes the servers cached, keep each "
                        "finished request's; docs/PROTOCOL.md, Prefix cache)")
    p.add_argument("--share-prefixes", action="store_true",
                   help="private swarm only: share cached prefixes with every holder of the swarm key")
    add_client_precision(p)
    add_push(p)
    add_speculative(p)
    add_swarm_key(p)


def run(args: argparse.Namespace) -> int:
    import socket

    import uvicorn

    from swarmlm.api.app import GatewayConfig, create_app
    from swarmlm.client.model import DistributedModelForCausalLM
    from swarmlm.client.tuning import find_tuned
    from swarmlm.model.checkpoint import load_tokenizer
    from swarmlm.errors import SwarmAccessDenied

    from swarmlm.api.guard import LOCAL_HOSTS, header_deadline_protocol

    own = () if args.host in ("0.0.0.0", "::", "") else (args.host,)
    from swarmlm.model.source import served_name

    name = args.served_model_name or served_name(args.model)
    ids = {ref: served_name(ref) for ref in args.adapter}  # --adapter as given -> its served id
    aliases = tuple((given, served) for given, served in [(args.model, name), *ids.items()] if given != served)
    config = GatewayConfig(model_name=name, adapter_names=tuple(ids.values()), model_aliases=aliases,
                           api_key=args.api_key,
                           max_streams_per_client=args.max_streams_per_client,
                           max_choices_per_request=args.max_choices_per_request,
                           max_prompt_chars=args.max_prompt_chars, max_body_bytes=args.max_body_bytes,
                           body_timeout_s=args.body_timeout, request_timeout_s=args.request_timeout,
                           allowed_hosts=(*LOCAL_HOSTS, *own, *args.allow_host), speculative=args.speculative)
    for ref in args.adapter:  # checked before anything loads
        settings = find_tuned(ref)[0]
        if settings is not None and settings.mode == "deep_ptune":
            raise ValueError(f"--adapter {ref}: a deep prompt generates without the servers' caches (swarmlm chat and "
                             "generate take it); the API serves soft prompts and LoRAs (docs/FINETUNING.md)")
    tokenizer = load_tokenizer(args.model)
    model = DistributedModelForCausalLM.from_pretrained(
        args.model, initial_peers=args.initial_peers, servers=args.servers, threads=args.threads,
        wait_for_blocks_s=args.wait_for_blocks,
        wait_for_loading_s=args.wait_for_loading, swarm_key=args.swarm_key, quant=args.quant,
        require_full_precision=args.require_full_precision, wire_dtype=args.wire_dtype, dtype=args.dtype,
        push=args.push, prefix_cache=not args.no_prefix_cache, prefix_share=args.share_prefixes,
    )
    try:
        adapters = {served: model.with_adapter(ref) for ref, served in ids.items()}  # (sharing the base's parts)
    except Exception:
        model.close()
        raise
    try:
        model.remote.refresh()  # learn the swarm before the first request (routing reuses this view)
    except SwarmAccessDenied:  # a private swarm whose key we lack: nothing will ever work
        model.close()
        raise
    except Exception as exc:  # an empty or unreachable swarm is reported per request (503), not fatal
        print(f"swarm not readable yet: {exc}", file=sys.stderr)
    app = create_app(model, tokenizer, config, adapters)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(1024)  # connections wait in the backlog until uvicorn accepts them
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5,
                                           http=header_deadline_protocol(args.header_timeout)))
    # one JSON line for scripts and tests (the port when --port 0), then a line for people
    print(json.dumps({"event": "ready", "url": f"http://{host}:{port}", "model": config.model_name,
                      "adapters": list(config.adapter_names)}), flush=True)
    served = ", ".join(repr(i) for i in (config.model_name, *config.adapter_names))
    print(f"OpenAI API at http://{host}:{port}/v1 (model {served}); monitor at http://{host}:{port}/",
          file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        model.close()
    return 0
