"""`swarmlm api --model NAME_OR_DIR --initial-peers ADDR [--adapter DIR|NAME ...] [--host H] [--port P] [--api-key K]`:
an OpenAI-compatible HTTP gateway to the swarm (the base model and each tuned model under its own id), with a live
monitor page at `/` (docs/API.md)."""
from __future__ import annotations

import argparse
import json
import sys

from swarmlm.api.config import LOCAL_HOSTS, GatewayConfig
from swarmlm.cli.args import add_client_precision, add_dtype, add_push, add_speculative, add_swarm_key, add_waits
from swarmlm.config import usable_cores

GATEWAY = GatewayConfig(model_name="(defaults)")  # the flags' defaults: each setting's one definition is its field

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
    p.add_argument("--max-streams-per-client", type=int, default=GATEWAY.max_streams_per_client,
                   help="concurrent choices (sessions) per API key, or per client IP without one; more get 429")
    p.add_argument("--max-choices-per-request", type=int, default=GATEWAY.max_choices_per_request,
                   help="prompts x n of one request")
    p.add_argument("--max-prompt-chars", type=int, default=GATEWAY.max_prompt_chars,
                   help="characters of a request's prompts or messages (checked before tokenizing)")
    p.add_argument("--max-body-bytes", type=int, default=GATEWAY.max_body_bytes, help="larger request bodies get 413")
    p.add_argument("--request-timeout", type=float, default=GATEWAY.request_timeout_s,
                   help="seconds a request may generate before it ends with 504")
    p.add_argument("--header-timeout", type=float, default=GATEWAY.header_timeout_s,
                   help="seconds a connection has to send a request's headers before it is closed")
    p.add_argument("--body-timeout", type=float, default=GATEWAY.body_timeout_s,
                   help="seconds a request's body has to arrive (408)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="also answer requests whose Host header names NAME (repeatable; '*' = any). Default: "
                        "localhost, 127.0.0.1, ::1 and --host when it is one address")
    add_waits(p)
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
    add_speculative(p, GATEWAY.speculative)
    add_swarm_key(p)


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    """The flags as the gateway's settings (served ids from --model / --served-model-name / --adapter)."""
    from swarmlm.model.source import served_name

    own = () if args.host in ("0.0.0.0", "::", "") else (args.host,)
    name = args.served_model_name or served_name(args.model)
    ids = {ref: served_name(ref) for ref in args.adapter}  # --adapter as given -> its served id
    aliases = tuple((given, served) for given, served in [(args.model, name), *ids.items()] if given != served)
    return GatewayConfig(model_name=name, adapter_names=tuple(ids.values()), model_aliases=aliases,
                         api_key=args.api_key, max_streams_per_client=args.max_streams_per_client,
                         max_choices_per_request=args.max_choices_per_request, max_prompt_chars=args.max_prompt_chars,
                         max_body_bytes=args.max_body_bytes, header_timeout_s=args.header_timeout,
                         body_timeout_s=args.body_timeout, request_timeout_s=args.request_timeout,
                         allowed_hosts=(*LOCAL_HOSTS, *own, *args.allow_host), speculative=args.speculative)


def run(args: argparse.Namespace) -> int:
    import socket

    import uvicorn

    from swarmlm.api.app import create_app
    from swarmlm.client.model import DistributedModelForCausalLM
    from swarmlm.client.tuning import find_tuned
    from swarmlm.collector import freeze_start_up
    from swarmlm.model.checkpoint import load_tokenizer
    from swarmlm.errors import SwarmAccessDenied

    from swarmlm.api.guard import header_deadline_protocol
    from swarmlm import event_loop

    config = gateway_config(args)
    ids = dict(zip(args.adapter, config.adapter_names))  # --adapter as given -> its served id
    for ref in args.adapter:  # a missing or unreadable folder is one line before anything loads
        find_tuned(ref)
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
    freeze_start_up()  # a process that runs for days: start-up's heap out of every collection (swarmlm/collector.py)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(1024)  # connections wait in the backlog until uvicorn accepts them
    host, port = sock.getsockname()[:2]
    # the loop swarmlm's other processes run (uvicorn's own "auto" would pick uvloop whatever SWARMLM_EVENT_LOOP says)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5,
                                           http=header_deadline_protocol(config.header_timeout_s),
                                           loop=event_loop.kind()))
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
