"""A private swarm (--swarm-key): holders work as in an open swarm; a client or a server without the key is refused
with a clear message, and a node without it cannot announce."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc
import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey

from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.errors import SwarmAccessDenied
from swarmlm.swarm.dht import announce, default_dht_prefix, fetch_records
from swarmlm.swarm.dht_thread import ThreadDHT
from swarmlm.swarm.identity import Identity
from swarmlm.swarm.private import AUTH_WINDOW_S, TokenChecker, create_swarm_key, load_swarm_key, make_token
from swarmlm.swarm.records import ServerRecord
from swarmlm.types import BlockRange
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire import swarm_pb2_grpc as pb_grpc
from tests.swarm_helpers import client_of, greedy_reference, server_processes

NEW_TOKENS = 6


def test_tokens_are_bound_to_key_method_and_time(tmp_path):
    key = create_swarm_key(tmp_path / "k")
    assert load_swarm_key(tmp_path / "k") == key and oct(os.stat(tmp_path / "k").st_mode & 0o777) == "0o600"
    (tmp_path / "short").write_text("abc")
    with pytest.raises(ValueError, match="at least"):
        load_swarm_key(tmp_path / "short")
    checker = TokenChecker(key)
    token = make_token(key, "/swarmlm.Swarm/Info")
    assert checker.check("/swarmlm.Swarm/Info", token) is None
    assert checker.check("/swarmlm.Swarm/Info", token) == "replayed swarm-key token"
    assert checker.check("/swarmlm.Swarm/Push", make_token(key, "/swarmlm.Swarm/Info")) == "wrong swarm key"
    assert checker.check("/swarmlm.Swarm/Info", make_token(b"x" * 32, "/swarmlm.Swarm/Info")) == "wrong swarm key"
    old = make_token(key, "/swarmlm.Swarm/Info", now=time.time() - 2 * AUTH_WINDOW_S)
    assert checker.check("/swarmlm.Swarm/Info", old).startswith("stale")
    assert checker.check("/swarmlm.Swarm/Info", None) == "no swarm-key token"
    assert checker.check("/swarmlm.Swarm/Info", "v1." + "9" * 300) == "malformed swarm-key token"


@pytest.fixture(scope="module")
def key_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("private") / "swarm.key"
    create_swarm_key(path)
    return str(path)


@pytest.fixture(scope="module")
def swarm(tiny_bloom, key_file):
    with server_processes(tiny_bloom, [BlockRange(0, 3), BlockRange(3, 6)], swarm_key_file=key_file) as swarm:
        yield swarm


@pytest.mark.slow
def test_holders_of_the_key_generate_exactly(swarm, tiny_bloom, key_file):
    ids, want = greedy_reference(tiny_bloom, "only members", NEW_TOKENS)
    client = client_of(swarm, swarm_key=load_swarm_key(key_file))
    pushing = client_of(swarm, swarm_key=load_swarm_key(key_file), push=True)
    try:
        out = client.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        assert out[0, ids.shape[1]:].tolist() == want
        # server-to-server pushes carry the key too: the first server's output reaches the second directly
        with torch.no_grad(), pushing.inference_session(max_length=ids.shape[1] + 4) as session:
            got = pushing.step_logits(session, ids)
            for _ in range(3):
                got = pushing.step_logits(session, got[:, -1:].argmax(-1))
            assert [len(step.hops) for step in session.steps] == [2] * 4
            assert all([h.pushed for h in step.hops] == [True, False] and step.failovers == step.stalls == 0
                       for step in session.steps)
    finally:
        client.close()
        pushing.close()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["dht", "direct", "wrong-key"])
def test_a_client_without_the_key_is_refused(swarm, tiny_bloom, how):
    peers = {"initial_peers": swarm.initial_peers} if how != "direct" else {"servers": swarm.addresses}
    extra = {"swarm_key": b"not-this-swarm's-key-0123456789"} if how == "wrong-key" else {}
    client = DistributedModelForCausalLM.from_pretrained(tiny_bloom, wait_for_blocks_s=60, **peers, **extra)
    try:
        with pytest.raises(SwarmAccessDenied, match="--swarm-key"):
            client.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2)
    finally:
        client.close()


@pytest.mark.slow
def test_no_rpc_is_served_without_the_key(swarm):
    with grpc.insecure_channel(swarm.addresses[0]) as channel:
        stub = pb_grpc.SwarmStub(channel)
        for call, request in ((stub.Info, pb.InfoRequest()), (stub.Push, pb.PushRequest(session_id="ab" * 16)),
                              (stub.Forward, pb.ForwardRequest(start_block=0, end_block=1)),
                              (stub.Backward, pb.BackwardRequest(start_block=0, end_block=1))):
            with pytest.raises(grpc.RpcError) as err:
                call(request, timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "private swarm" in err.value.details()


@pytest.mark.slow
def test_a_server_without_the_key_is_refused_and_cannot_announce(swarm, tiny_bloom, key_file):
    # the CLI: exit 2 with one line naming the flag
    stranger = swarm.start_server(BlockRange(0, 6), extra=["--swarm-key", ""], wait=False)
    assert stranger.proc.wait(180) == 2
    last = stranger.log_path.read_text().strip().splitlines()[-1]
    assert last.startswith("swarmlm server:") and "private swarm" in last and "--swarm-key" in last
    # a node without the key announcing anyway (a valid identity record): members never see it
    me = Identity(RSAPrivateKey.process_wide())  # the default signer of the nodes below
    keyless = ThreadDHT(swarm.initial_peers, client_mode=False)
    member = ThreadDHT(swarm.initial_peers, client_mode=True, swarm_key=load_swarm_key(key_file))
    try:
        dht_prefix = default_dht_prefix(tiny_bloom)
        announce(keyless, dht_prefix, ServerRecord(server_id=me.server_id, address="127.0.0.1:9", start=0, end=6), 30)
        seen = fetch_records(member, dht_prefix, range(6), swarm_key=load_swarm_key(key_file))
        assert set(seen) == {s.server_id for s in swarm.servers[:2]}  # (not the refused stranger)
    finally:
        member.shutdown()
        keyless.shutdown()


@pytest.mark.slow
def test_generate_cli_without_the_key_exits_2_with_one_line(swarm, tiny_bloom):
    env = {k: v for k, v in os.environ.items() if k != "SWARMLM_SWARM_KEY_FILE"}
    done = subprocess.run(
        [sys.executable, "-m", "swarmlm.cli.main", "generate", "--model", tiny_bloom, "--initial-peers",
         *swarm.initial_peers, "--input-ids", "1,2,3", "--max-new-tokens", "2"],
        capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("swarmlm generate:") and "private swarm" in last and "--swarm-key" in last


@pytest.mark.slow
def test_the_framed_port_takes_only_a_fresh_token_of_the_key_as_grpc_does(swarm, key_file):
    from swarmlm.bench.frame_attacks import exchange, frame_port, open_request
    from swarmlm.wire import frames

    key = load_swarm_key(key_file)
    host, port = swarm.addresses[0].rsplit(":", 1)[0], frame_port(swarm.addresses[0], key)
    assert port > 0
    token = make_token(key, "/swarmlm.Swarm/Inference")
    refused = {"no token": None, "another key": make_token(b"x" * 32, "/swarmlm.Swarm/Inference"),
               "another call's token": make_token(key, "/swarmlm.Swarm/Info")}
    for why, bad in refused.items():
        answers = exchange(host, port, frames.hello(frames.Purpose.STREAM, bad) + open_request(3), half_close=True)
        assert answers[-1].startswith("STATUS UNAUTHENTICATED") and "--swarm-key" in answers[-1], (why, answers)
    hello = frames.hello(frames.Purpose.STREAM, token)
    assert exchange(host, port, hello + open_request(3), half_close=True) == ["REPLY", "STATUS OK "]
    replayed = exchange(host, port, hello + open_request(3), half_close=True)
    assert replayed[-1].startswith("STATUS UNAUTHENTICATED") and "replayed" in replayed[-1], replayed
    # a connection carries one stream after another: each stream's HELLO shows a fresh token of its own
    end = frames.frame(frames.Kind.END)

    def hello_fresh() -> bytes:
        return frames.hello(frames.Purpose.STREAM, make_token(key, "/swarmlm.Swarm/Inference"))

    def stream() -> bytes:  # a whole stream, ended cleanly
        return hello_fresh() + open_request(3) + end

    assert exchange(host, port, stream() + stream(), half_close=True) == \
        ["REPLY", "STATUS OK ", "REPLY", "STATUS OK "]
    answers = exchange(host, port, stream() + hello + open_request(3), half_close=True)  # (hello: a used token)
    assert answers[:2] == ["REPLY", "STATUS OK "] and answers[2].startswith("STATUS UNAUTHENTICATED"), answers
    answers = exchange(host, port, stream() + frames.hello(frames.Purpose.STREAM, None) + open_request(3),
                       half_close=True)
    assert answers[2].startswith("STATUS UNAUTHENTICATED"), answers
