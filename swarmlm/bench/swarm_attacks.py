"""Attacks that need a swarm, not one server (issue 39, holes 7 and 8, and hole 1 between servers); rows of
`benchmarks/attacks.py --swarm`, light versions in tests/test_attacks.py.

- `adapter_versions`: a stranger's server announces an honest adapter's name with weights of its own. Clients
  asking by name must never mix the two versions in one generation, clients pinning `name@fingerprint` must never
  reach the stranger, and every output must be its version's (PEFT on transformers).
- `lossy_wire_under_load`: a stranger loads a relayed server's relay with big transfers while clients with the
  default wire format (`auto`) generate greedily through that relay: their answers must stay transformers'
  (before, `auto` chose int8 on a link measured slow, and a gateway's greedy answers changed).
- `push_relay_hijack`: a stranger's record names a relayed server's address with a relay of its own; a server
  pushing to that address must go through the relay of the server's own record (before, the last record read won).
- `stuck_loader`: a peer announces the blocks nobody serves as `loading` and never serves them: a client waiting for
  them waits `wait_for_loading_s` in all, says so once, then `MissingBlocks` naming the loader (issue 35).
"""
from __future__ import annotations

import threading
from pathlib import Path

import torch
from hivemind.dht.crypto import RSASignatureValidator

from swarmlm.types import BlockRange


def make_lora(model_dir: str, path: Path, seed: int) -> str:
    """A PEFT LoRA (r 4, q/v projections) of `model_dir` with random A and B (so it changes the outputs), saved at
    `path` (whose name is the adapter's name)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                          LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                     task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    peft.save_pretrained(path)
    return str(path)


def _lora_logits(model_dir: str, adapter: str, ids: torch.Tensor) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return PeftModel.from_pretrained(base, adapter).eval()(ids).logits


def adapter_versions(swarm, workdir: Path, by_name: int = 4, pinned: int = 2, steps: int = 2) -> dict:
    """On `swarm` (a LocalSwarm with a DHT, no server yet): honest servers hold `my-adapter` on [0, 3) and [3, 6); a
    stranger's three servers hold another `my-adapter` on [0, 3), [3, 6) and [0, 6) (more servers: a client asking
    by name takes the version most servers offer, so the stranger's). `by_name` fresh clients ask for `my-adapter`,
    `pinned` ask for the honest `my-adapter@fingerprint`; each runs `steps` sessions. Counts: sessions whose route
    mixed versions, pinned sessions routed to the stranger, outputs not their version's, versions used at all."""
    from swarmlm.client.model import DistributedModelForCausalLM
    from swarmlm.server.adapters import adapter_fingerprint

    honest = make_lora(swarm.model_dir, workdir / "honest" / "my-adapter", seed=0)
    strange = make_lora(swarm.model_dir, workdir / "stranger" / "my-adapter", seed=1)
    fp = {honest: adapter_fingerprint(honest), strange: adapter_fingerprint(strange)}
    held = [(BlockRange(0, 3), honest), (BlockRange(3, 6), honest),
            (BlockRange(0, 3), strange), (BlockRange(3, 6), strange), (BlockRange(0, 6), strange)]
    servers = [swarm.start_server(blocks, extra=["--adapters", path], wait=False) for blocks, path in held]
    swarm.wait_ready(servers)
    version = {s.server_id: fp[path] for s, (_, path) in zip(servers, held)}
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(1))
    want = {fp[a]: _lora_logits(swarm.model_dir, a, ids) for a in (honest, strange)}
    result = {"attack": f"another version of an adapter's name (3 stranger's servers, 2 honest; {by_name} clients "
                        f"by name, {pinned} pinned)", "sessions": 0, "mixed": 0, "pinned_to_stranger": 0, "wrong": 0,
              "versions_seen": set()}
    for asked in ["my-adapter"] * by_name + [f"my-adapter@{fp[honest]}"] * pinned:
        client = DistributedModelForCausalLM.from_pretrained(swarm.model_dir, initial_peers=swarm.initial_peers,
                                                             dtype="float32", active_adapter=asked)
        try:
            for _ in range(steps):
                with torch.no_grad(), client.inference_session(max_length=16) as session:
                    got = client.step_logits(session, ids)
                    used = {version.get(s.server_id, "?") for s in session.route_spans()}
                result["sessions"] += 1
                result["mixed"] += len(used) > 1
                result["pinned_to_stranger"] += "@" in asked and used != {fp[honest]}
                result["wrong"] += len(used) != 1 or (got - want[next(iter(used))]).abs().max().item() > 1e-4
                result["versions_seen"] |= used
        finally:
            client.close()
    result["versions_seen"] = len(result["versions_seen"])
    return result


def lossy_wire_under_load(swarm, rounds: int = 4, loaders: int = 2, load_tokens: int = 2048) -> dict:
    """On `swarm` (a LocalSwarm with a DHT, no server yet): one server behind NAT (every block, reached through the
    DHT node as its relay). `loaders` stranger threads send prompts of `load_tokens` tokens through the same relay
    (big transfers both ways) while a client with the default wire format generates greedily, `rounds` times a short
    and a long prompt (over 14 tokens: those the old `auto` packed first); its answers are compared with
    transformers' greedy tokens, and the wire formats its link to the server would choose are collected (only
    float32 may appear)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from swarmlm.client.model import DistributedModelForCausalLM

    config = AutoConfig.from_pretrained(swarm.model_dir)
    server = swarm.start_server(BlockRange(0, int(config.num_hidden_layers)), extra=["--reachability", "relayed"])
    ref = AutoModelForCausalLM.from_pretrained(swarm.model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(4, 256, (1, n), generator=gen) for n in (6, 40)]
    with torch.no_grad():
        want = [ref.generate(p, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                             attention_mask=torch.ones_like(p))[0, p.shape[1]:].tolist() for p in prompts]
    stop, loading, sent = threading.Event(), threading.Event(), [0]

    def load() -> None:
        stranger = DistributedModelForCausalLM.from_pretrained(swarm.model_dir, initial_peers=swarm.initial_peers,
                                                               wire_dtype="float32")
        big = torch.randint(4, 256, (1, load_tokens))
        try:
            while not stop.is_set():
                with torch.no_grad():
                    stranger(big)
                sent[0] += 1
                loading.set()
        except Exception:  # (a loader that fails stops loading; the honest client's answers are what counts)
            pass
        finally:
            loading.set()
            stranger.close()

    threads = [threading.Thread(target=load, daemon=True) for _ in range(loaders)]
    client = DistributedModelForCausalLM.from_pretrained(swarm.model_dir, initial_peers=swarm.initial_peers)
    message = 4 * int(config.hidden_size)  # bytes of one token's float32 hidden state
    result = {"attack": f"a relayed link loaded by {loaders} strangers' {load_tokens}-token prompts (hole 8)",
              "answers": 0, "exact": 0, "wire_formats": set(), "load_requests": 0}
    try:
        for t in threads:
            t.start()
        loading.wait(300)  # (the honest client starts once the load goes through the relay)
        for _ in range(rounds):
            for prompt, expected in zip(prompts, want):
                with torch.no_grad():
                    got = client.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8,
                                          min_new_tokens=8, do_sample=False)
                result["answers"] += 1
                result["exact"] += got[0, prompt.shape[1]:].tolist() == expected
            for n_tokens in (1, 40, 2048):  # a decode step's, a prompt's, a long prompt's message
                result["wire_formats"].add(client.remote.channels.wire_dtype_for(server.address, n_tokens * message))
    finally:
        stop.set()
        for t in threads:
            t.join(120)
        client.close()
    result["load_requests"] = sent[0]
    result["wire_formats"] = sorted(result["wire_formats"])
    return result


def push_relay_hijack(swarm, generations: int = 2, new_tokens: int = 6, strangers: int = 1,
                      pause_s: float = 0.0) -> dict:
    """(Hole 1, between servers.) On `swarm` (a LocalSwarm with a DHT, no server yet): server A, direct, on the first
    half of the blocks; server B, behind NAT (its relay: the DHT node), on the second half. `strangers` strangers,
    each with a fresh key of its own, publish B's record under their own ids, naming a dead relay, every second.
    Then:
    - in process, a pushing server's network (server/network.py) reads the records with B's first and with B's
      last, and checks the claims once per read until B owns its address (at most `rounds` reads): B's address
      must be owned by B and tunnelled through B's relay, whichever record came last;
    - `generations` clients generate greedily with push on (A pushes to B): every answer must be transformers',
      and A's pushes must go through (`push_refused` per generation: only the first may lose pushes, while A's
      reads reach B's claim; `pause_s` between generations, past A's one DHT read a second, so that each generation
      comes after a read of its own)."""
    import dataclasses

    from transformers import AutoConfig, AutoModelForCausalLM

    from swarmlm import event_loop
    from swarmlm.bench.relay_attacks import _record_with_relay
    from swarmlm.config import ServerConfig
    from swarmlm.server.network import MAX_CLAIMS, ServerNetwork
    from swarmlm.swarm.dht import announce, default_dht_prefix, fetch_records, owner_subkey
    from swarmlm.swarm.dht_thread import ThreadDHT
    from swarmlm.swarm.identity import Identity

    n = int(AutoConfig.from_pretrained(swarm.model_dir).num_hidden_layers)
    a = swarm.start_server(BlockRange(0, n // 2), wait=False)
    b = swarm.start_server(BlockRange(n // 2, n), extra=["--reachability", "relayed"], wait=False)
    swarm.wait_ready([a, b])
    prefix, keys = default_dht_prefix(swarm.model_dir), [Identity.generate() for _ in range(strangers)]
    attacker = ThreadDHT(swarm.initial_peers, client_mode=False, validator=_ManyKeys([k.validator for k in keys]))
    stop, rounds = threading.Event(), -(-(strangers + 1) // MAX_CLAIMS)
    result = {"attack": f"{strangers} strangers' records naming a relayed push target with a dead relay (hole 1, "
                        "pushes)", "owner_is_server": [], "tunnel_through_own_relay": [], "answers": 0, "exact": 0,
              "steps": 0, "pushed": 0, "push_refused": 0, "push_refused_per_generation": []}
    try:
        honest = _record_with_relay(attacker, prefix, b.server_id, stop, block=n // 2)
        dead = f"/ip4/127.0.0.1/tcp/9/p2p/{honest.relay.split('/')[-1]}"  # (a closed port)
        lies = [dataclasses.replace(honest, server_id=k.server_id, relay=dead) for k in keys]

        def publish(key, lie) -> None:
            while not stop.is_set():
                try:
                    announce(attacker, prefix, lie, 8.0, subkey=owner_subkey(key.server_id, key.validator))
                except Exception:  # (the attacker's node stopping under it at the end)
                    return
                stop.wait(1.0)

        for key, lie in zip(keys, lies):
            threading.Thread(target=publish, args=(key, lie), daemon=True).start()
        for _ in range(150):  # (their records readable: then the readers come)
            if all(k.server_id in fetch_records(attacker, prefix, [n // 2]) for k in keys) or stop.wait(0.2):
                break
        else:
            raise RuntimeError("the strangers' records were not stored")
        for order in ((honest, *lies), (*lies, honest)):  # whichever record a read lists last
            network = ServerNetwork(ServerConfig(model_dir=swarm.model_dir, blocks=None, reachability="direct",
                                                 initial_peers=tuple(swarm.initial_peers)))
            try:
                for _ in range(rounds):
                    network.learn(order)
                    if event_loop.run(network.check_relay(honest.address)):
                        break
                network.learn(order)  # (read again: an owned address's tunnel moves only with its owner's record)
                result["owner_is_server"].append(network.owners.get(honest.address) == b.server_id)
                result["tunnel_through_own_relay"].append(network.tunnels.relays.get(honest.address) == honest.relay)
            finally:
                network.close()
        _generate_pushed(swarm, n, generations, new_tokens, result, AutoModelForCausalLM, pause_s)
    finally:
        stop.set()
        attacker.shutdown()
    return result


class _ManyKeys(RSASignatureValidator):
    """One DHT node writing records under several keys: each record is signed by the key its subkey names."""

    def __init__(self, signers: list[RSASignatureValidator]) -> None:
        super().__init__(signers[0]._private_key)
        self.signers = signers

    def sign_value(self, record) -> bytes:
        for signer in self.signers:
            if signer.local_public_key in record.subkey:
                return signer.sign_value(record)
        return record.value


def _generate_pushed(swarm, n: int, generations: int, new_tokens: int, result: dict, auto_model,
                     pause_s: float = 0.0) -> None:
    from swarmlm.client.model import DistributedModelForCausalLM

    ref = auto_model.from_pretrained(swarm.model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    for g in range(generations):
        if g and pause_s:
            threading.Event().wait(pause_s)
        ids = torch.randint(4, 256, (1, 8), generator=gen)
        with torch.no_grad():
            want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False)[0, 8:].tolist()
        client = DistributedModelForCausalLM.from_pretrained(swarm.model_dir, initial_peers=swarm.initial_peers,
                                                             push="on")
        try:
            with torch.no_grad():
                got = client.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, do_sample=False)[0, 8:].tolist()
            steps = client.last_stats.steps
        finally:
            client.close()
        result["answers"] += 1
        result["exact"] += got == want
        result["steps"] += len(steps)
        result["pushed"] += sum(bool(s.hops) and s.hops[0].pushed for s in steps)
        result["push_refused"] += sum(s.push_refused for s in steps)
        result["push_refused_per_generation"].append(sum(s.push_refused for s in steps))


def stuck_loader(swarm, server_args=(), wait_for_loading_s: float = 6.0) -> dict:
    """On `swarm` (a LocalSwarm with a DHT, no server yet): a server of the first half of the blocks, and a stranger's
    record announcing the second half as loading (a fresh key, never serving). A client with wait_for_blocks_s 1 s
    generates: the error it ends with and its warnings about loading blocks."""
    import logging

    from swarmlm.errors import MissingBlocks
    from swarmlm.model.checkpoint import load_config
    from swarmlm.swarm.dht import announce, default_dht_prefix, owner_subkey
    from swarmlm.swarm.dht_thread import ThreadDHT
    from swarmlm.swarm.identity import Identity
    from swarmlm.client.model import DistributedModelForCausalLM
    from swarmlm.swarm.records import LOADING, ServerRecord
    from swarmlm.wire.protocol import PROTOCOL_VERSION

    blocks = int(load_config(swarm.model_dir).num_hidden_layers)
    swarm.start_server(BlockRange(0, blocks // 2), extra=list(server_args))
    stranger = Identity.generate()
    node = ThreadDHT(swarm.initial_peers, client_mode=False, validator=stranger.validator)
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda r: lines.append(r.getMessage()) if "as loading" in r.getMessage() else None
    logging.getLogger("swarmlm").addHandler(handler)
    client, error = None, ""
    try:
        # (of our wire protocol: a client waits only for such loaders, as it routes only to such servers)
        record = ServerRecord(server_id=stranger.server_id, address="127.0.0.1:1", start=blocks // 2, end=blocks,
                              state=LOADING, protocol=PROTOCOL_VERSION)
        announce(node, default_dht_prefix(swarm.model_dir), record, 60,
                 subkey=owner_subkey(stranger.server_id, stranger.validator))
        client = DistributedModelForCausalLM.from_pretrained(
            swarm.model_dir, initial_peers=swarm.initial_peers, wait_for_blocks_s=1.0,
            wait_for_loading_s=wait_for_loading_s, dtype="float32", quant="auto")
        try:
            client.generate(torch.tensor([[1, 17, 250]]), max_new_tokens=2)
        except MissingBlocks as exc:
            error = str(exc)
    finally:
        logging.getLogger("swarmlm").removeHandler(handler)
        if client is not None:
            client.close()
        node.shutdown()
    return {"attack": "a stranger announces the missing blocks as loading, forever", "loader": stranger.server_id,
            "error": error, "loading_lines": lines}


def tampering_relay(swarm, new_tokens: int = 8, push: str = "on") -> dict:
    """(Hole 1, end to end: the probe's relay that splices and flips.) On `swarm` (a LocalSwarm with a DHT, no server
    yet): server A, direct, on the first half of the blocks; server R, behind NAT, on the second half, listening
    through a relay that negates every hidden state crossing it (bench/tamper_relay.py: the client's steps to R, A's
    pushes to R and R's replies). Once the relay has flipped a message, a direct spare of R's blocks starts. A client
    (push `push`) generates greedily: its tokens must be transformers' (the flips refused by whichever end got them,
    R failed over to the spare), not the flipped ones. (The client waits up to 300 s for the spare and retries up to
    12 times: how many times R fails before the spare is up depends on the machine's load, not on the keys.)"""
    from transformers import AutoConfig, AutoModelForCausalLM

    from swarmlm.bench.tamper_relay import TamperingRelay
    from swarmlm.client.model import DistributedModelForCausalLM

    n = int(AutoConfig.from_pretrained(swarm.model_dir).num_hidden_layers)
    result = {"attack": f"a relay that splices and flips the sign of hidden states (hole 1, end to end; push {push})",
              "answers": 0, "exact": 0, "flipped": 0, "failovers": 0}
    with TamperingRelay() as relay:
        peers = list(swarm.initial_peers)
        a = swarm.start_server(BlockRange(0, n // 2), wait=False)
        swarm.initial_peers = [relay.address, *peers]  # (relays first: R listens through the first that takes it)
        try:
            r = swarm.start_server(BlockRange(n // 2, n), extra=["--reachability", "relayed"], wait=False)
        finally:
            swarm.initial_peers = peers
        swarm.wait_ready([a, r])
        stop = threading.Event()

        def spare() -> None:  # (R alone serves its blocks until the relay has shown what it does)
            while relay.flipped == 0 and not stop.wait(0.1):
                pass
            if not stop.is_set():
                swarm.start_server(BlockRange(n // 2, n), wait=False)

        helper = threading.Thread(target=spare, daemon=True)
        helper.start()
        ids = torch.randint(4, 256, (1, 8), generator=torch.Generator().manual_seed(5))
        ref = AutoModelForCausalLM.from_pretrained(swarm.model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False)[0, 8:].tolist()
        client = DistributedModelForCausalLM.from_pretrained(swarm.model_dir, initial_peers=swarm.initial_peers,
                                                             push=push, max_retries=12, wait_for_blocks_s=300.0)
        try:
            with torch.no_grad():
                got = client.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, do_sample=False)[0, 8:].tolist()
            result["failovers"] = sum(s.failovers for s in client.last_stats.steps)
        finally:
            client.close()
            stop.set()
            helper.join(60)
        result.update(answers=1, exact=int(got == want), flipped=relay.flipped)
    return result
