"""Malformed requests sent straight to a server get clear errors; the server and other sessions go on."""
from __future__ import annotations

import grpc
import pytest
import torch

from swarmlm.types import BlockRange
from swarmlm.wire import codec
from swarmlm.wire import swarm_pb2 as pb
from tests.swarm_helpers import RawStream, in_process_server, stub

H = 64  # tiny-bloom hidden size


@pytest.fixture(scope="module")
def server(tiny_bloom):
    # a lone server reached by address (the protocol: in this process); small limits so they can be hit cheaply
    with in_process_server(tiny_bloom, BlockRange(1, 4), max_message_bytes=1 << 20, max_length_tokens=64,
                           cache_bytes=1 << 20, session_idle_timeout_s=3.0) as server:
        yield server.address


def open_session(address: str) -> tuple[RawStream, pb.InferenceReply]:
    return RawStream.open(address, 1, 4)


def step(hidden: torch.Tensor, mask: torch.Tensor | None = None) -> pb.InferenceRequest:
    return pb.InferenceRequest(step=pb.InferenceStep(hidden=codec.encode(hidden),
                                                     attention_mask=codec.encode(mask) if mask is not None else None))


def test_bad_steps_are_refused_and_the_session_survives(server):
    s, opened = open_session(server)
    assert opened.session_id
    x = torch.randn(1, 5, H)
    ok = s.send(step(x))
    assert not ok.HasField("error") and ok.position == 5
    bad_requests = {
        "bytes do not match": pb.InferenceRequest(step=pb.InferenceStep(hidden=pb.Tensor(
            data=b"\0" * 10, dtype="float32", shape=[1, 1, H]))),
        "unknown dtype": pb.InferenceRequest(step=pb.InferenceStep(hidden=pb.Tensor(
            data=b"\0" * 4 * H, dtype="complex64", shape=[1, 1, H]))),
        "hidden size 32": step(torch.randn(1, 1, 32)),
        "expected shape": step(torch.randn(1, H)),
        "batch 2": step(torch.randn(2, 1, H)),
        "max_length": step(torch.randn(1, 40, H)),
        "NaN": step(torch.full((1, 1, H), float("nan"))),
        "infinite": step(torch.full((1, 1, H), float("inf")).half()),
        "values must be 0 or 1": step(torch.randn(1, 1, H), torch.tensor([[7]])),
        "not a float": step(torch.ones(1, 1, H, dtype=torch.long)),
    }
    for needle, request in bad_requests.items():
        reply = s.send(request)
        assert reply.HasField("error"), needle
        assert needle in reply.error.message, (needle, reply.error.message)
        assert reply.position == 5  # nothing changed
    # the session is intact: its next step continues at position 5 and matches a fresh session's output
    y = torch.randn(1, 1, H)
    after = s.send(step(y))
    assert not after.HasField("error") and after.position == 6
    fresh, _ = open_session(server)
    fresh.send(step(x))
    again = fresh.send(step(y))
    assert torch.allclose(codec.decode(after.hidden), codec.decode(again.hidden))
    s.end()
    fresh.end()


def test_protocol_errors_get_grpc_status(server):
    for request, code in [
        (pb.InferenceRequest(session_id="no-such-session", step=pb.InferenceStep()), grpc.StatusCode.NOT_FOUND),
        (pb.InferenceRequest(step=pb.InferenceStep()), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.InferenceRequest(open=pb.OpenSession(start_block=0, end_block=4, batch_size=1, max_length=8)),
         grpc.StatusCode.INVALID_ARGUMENT),  # block 0 is not served here
        (pb.InferenceRequest(open=pb.OpenSession(start_block=1, end_block=4, batch_size=1, max_length=999)),
         grpc.StatusCode.INVALID_ARGUMENT),  # over the server's max length
        (pb.InferenceRequest(open=pb.OpenSession(start_block=1, end_block=4, batch_size=60, max_length=64)),
         grpc.StatusCode.RESOURCE_EXHAUSTED),  # cache budget: 2*3*60*64*64*4 bytes > 1 MiB
    ]:
        s = RawStream(server)
        with pytest.raises(grpc.RpcError) as err:
            s.send(request)
        assert err.value.code() == code, (request, err.value.details())
        assert err.value.details()
        s.end()


def test_oversized_message_is_refused(server):
    s, _ = open_session(server)
    with pytest.raises(grpc.RpcError) as err:
        s.send(step(torch.randn(1, 5000, H)))  # 1.3 MB > the 1 MiB limit
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    s.end()


def test_forward_validates_and_computes(server):
    client = stub(server)
    with pytest.raises(grpc.RpcError) as err:
        client.Forward(pb.ForwardRequest(start_block=1, end_block=4, hidden=codec.encode(torch.randn(1, 3, 7))))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "hidden size" in err.value.details()
    reply = client.Forward(pb.ForwardRequest(start_block=2, end_block=4, hidden=codec.encode(torch.randn(2, 3, H))))
    assert list(codec.decode(reply.hidden).shape) == [2, 3, H] and reply.timing.compute_s > 0


def test_sessions_release_cache_and_idle_sessions_expire(server):
    client = stub(server)
    base = client.Info(pb.InfoRequest())
    s, _ = open_session(server)
    opened = client.Info(pb.InfoRequest())  # an open reserves no cache: its first step does
    assert opened.cache_bytes_free == base.cache_bytes_free and opened.active_sessions == base.active_sessions + 1
    assert not s.send(step(torch.randn(1, 1, H))).HasField("error")
    during = client.Info(pb.InfoRequest())
    assert during.cache_bytes_free < base.cache_bytes_free and during.active_sessions == base.active_sessions + 1
    s.end()  # a clean end of stream closes the session
    import time

    deadline = time.time() + 60
    while client.Info(pb.InfoRequest()).active_sessions != base.active_sessions and time.time() < deadline:
        time.sleep(0.1)
    assert client.Info(pb.InfoRequest()).cache_bytes_free == base.cache_bytes_free
    # a stream that goes silent: the session is closed after the idle timeout (3 s here; polled, as a busy
    # machine may take longer to get to it)
    s2, _ = open_session(server)
    deadline = time.time() + 60
    while client.Info(pb.InfoRequest()).active_sessions != base.active_sessions:
        assert time.time() < deadline, "an idle session was never closed"
        time.sleep(0.2)
    with pytest.raises(grpc.RpcError):
        s2.send(step(torch.randn(1, 1, H)))
    s2.end()


def _status(call, request) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=30)
    assert err.value.details()
    return err.value.code()


def test_unary_rpcs_refuse_through_one_status_map(server):
    """Real refusals over gRPC: each unary RPC gives an error class the status server/unary.py's STATUS names."""
    from swarmlm.errors import InvalidRequest, NotPermitted, UnknownSession
    from swarmlm.server.unary import STATUS

    client = stub(server)
    with grpc.insecure_channel(server) as channel:
        for rpc in ("Forward", "Backward", "Info", "Push"):  # bytes that do not parse
            assert _status(channel.unary_unary(f"/swarmlm.Swarm/{rpc}"), b"\xff\xff\xff") == STATUS[InvalidRequest]
    outside = dict(start_block=0, end_block=4, hidden=codec.encode(torch.randn(1, 2, H)))  # block 0: not here
    assert _status(client.Forward, pb.ForwardRequest(**outside)) == STATUS[InvalidRequest]
    assert _status(client.Backward, pb.BackwardRequest(**outside, grad_output=outside["hidden"])) == \
        STATUS[InvalidRequest]
    s, opened = open_session(server)
    push = dict(session_id=opened.session_id, step=pb.InferenceStep(hidden=codec.encode(torch.randn(1, 1, H))))
    assert _status(client.Push, pb.PushRequest(**push, secret=opened.session_secret)) == STATUS[InvalidRequest]
    push["step"].step_id = 1
    assert _status(client.Push, pb.PushRequest(**push, secret=b"\0" * 16)) == STATUS[NotPermitted]
    assert _status(client.Push, pb.PushRequest(**{**push, "session_id": "f" * 32}, secret=opened.session_secret)) \
        == STATUS[UnknownSession]
    s.end()
    resume = RawStream(server)  # the stream's first message maps with the same table
    with pytest.raises(grpc.RpcError) as err:
        resume.send(pb.InferenceRequest(session_id="f" * 32, step=pb.InferenceStep()))
    assert err.value.code() == STATUS[UnknownSession]
    resume.end()


@pytest.mark.parametrize("error", ["InvalidRequest", "CapacityExceeded", "UnknownSession", "NotPermitted",
                                   "RuntimeError"])
def test_every_unary_rpc_gives_an_error_class_the_same_status(tiny_bloom, error):
    """Whatever a unary RPC's handler raises, the status comes from one map (server/unary.py): the same for every
    RPC; an unexpected error is INTERNAL and names the RPC."""
    import asyncio

    from swarmlm import errors
    from swarmlm.config import ServerConfig
    from swarmlm.server.frame_server import FrameContext
    from swarmlm.server.scheduler import Scheduler
    from swarmlm.server.service import ServerStats, SwarmService
    from swarmlm.server.stage import Stage
    from swarmlm.server.unary import status_of

    exc_type = getattr(errors, error, None) or RuntimeError
    blocks = BlockRange(0, 2)
    service = SwarmService(ServerConfig(model_dir=tiny_bloom, blocks=blocks), Stage(tiny_bloom, blocks),
                           Scheduler(1), ServerStats())

    async def refuse(request, admission):
        admission.charge(1000)  # held until the call ends, whatever happens
        raise exc_type("refused here")

    service._forward = service._info = service.streams.push = service.training.backward = refuse
    calls = {"Forward": pb.ForwardRequest(), "Backward": pb.BackwardRequest(), "Info": pb.InfoRequest(),
             "Push": pb.PushRequest()}

    async def each() -> dict[str, tuple[grpc.StatusCode, str]]:
        got = {}
        for rpc, request in calls.items():
            context = FrameContext("ipv4:127.0.0.1:5000")
            await getattr(service, rpc)(request, context)
            got[rpc] = (context.code, context.details)
        return got

    try:
        got = asyncio.run(each())
    finally:
        service.scheduler.stop()
    expected = {"InvalidRequest": grpc.StatusCode.INVALID_ARGUMENT, "NotPermitted": grpc.StatusCode.PERMISSION_DENIED,
                "CapacityExceeded": grpc.StatusCode.RESOURCE_EXHAUSTED, "UnknownSession": grpc.StatusCode.NOT_FOUND,
                "RuntimeError": grpc.StatusCode.INTERNAL}[error]
    assert status_of(exc_type("x")) == expected
    for rpc, (code, details) in got.items():
        assert code == expected, rpc
        internal = code == grpc.StatusCode.INTERNAL
        assert details == (f"{rpc.lower()} failed: refused here" if internal else "refused here"), rpc
    assert not service.load.held  # every charge released
