"""The framed step protocol's envelope (wire/frames.py): frames read back as written, and every broken frame is a
FrameError with a one-line reason. Against a server: tests/test_attacks.py, tests/test_fuzz_rpc.py."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from swarmlm.wire import frames
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire.frames import HEADER, FrameError, Kind, Purpose
from swarmlm.wire.protocol import PROTOCOL_VERSION


def _read_all(data: bytes, max_body_bytes: int = 1024) -> list:
    async def run() -> list:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        out = []
        while (got := await frames.read_frame(reader, max_body_bytes, 1.0)) is not None:
            out.append(got)
        return out

    return asyncio.run(run())


def test_both_transports_parse_requests_through_one_table():
    """server/inbound.py's METHODS and request_of serve gRPC and the framed port alike: a request reads back as
    sent, bytes that do not parse are UNPARSABLE (the handlers answer INVALID_ARGUMENT); the framed port has no
    parser of its own."""
    import inspect

    from swarmlm.server import frame_server
    from swarmlm.server.inbound import METHODS, UNPARSABLE, request_of

    assert set(METHODS) == set(pb.DESCRIPTOR.services_by_name["Swarm"].methods_by_name)
    for method, (request_type, _, _) in METHODS.items():
        assert request_of(method, b"\xff\xff\xff") is UNPARSABLE
        sample = request_type()
        assert request_of(method, sample.SerializeToString()) == sample
    assert "FromString" not in inspect.getsource(frame_server)


def test_frames_read_back_as_written():
    data = frames.hello(Purpose.STREAM, "v1.tok") + frames.frame(Kind.REQUEST, b"abc") + frames.frame(Kind.END)
    got = _read_all(data)
    assert [k for k, _ in got] == [Kind.HELLO, Kind.REQUEST, Kind.END]
    assert frames.parse_hello(got[0][1]) == (Purpose.STREAM, "v1.tok")
    assert frames.parse_hello(frames.hello(Purpose.PUSH, None)[HEADER.size:]) == (Purpose.PUSH, None)
    assert got[1][1] == b"abc" and got[2][1] == b""
    status = frames.status(grpc.StatusCode.NOT_FOUND, "no such session")[HEADER.size:]
    assert frames.parse_status(status) == (grpc.StatusCode.NOT_FOUND, "no such session")
    assert frames.parse_status(b"NOT_A_CODE\nx") == (grpc.StatusCode.UNKNOWN, "x")


@pytest.mark.parametrize("data, reason", [
    (HEADER.pack(1025, Kind.REQUEST) + b"x" * 1025, "oversized frame: 1025 bytes exceed the limit of 1024"),
    (HEADER.pack(3, 99) + b"abc", "unknown frame kind 99"),
    (HEADER.pack(3, Kind.REQUEST)[:2], "truncated frame: the connection ended after 2 of 5 header bytes"),
    (HEADER.pack(10, Kind.REQUEST) + b"abc", "truncated frame: the connection ended after 3 of 10 body bytes"),
])
def test_broken_frames_are_one_line_errors(data, reason):
    with pytest.raises(FrameError) as err:
        _read_all(frames.frame(Kind.END) + data)
    assert str(err.value) == reason


def test_a_stalled_frame_body_times_out():
    async def run() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(HEADER.pack(10, Kind.REQUEST) + b"abc")  # and nothing more, no EOF
        await frames.read_frame(reader, 1024, body_timeout_s=0.05)

    with pytest.raises(FrameError, match="did not arrive within"):
        asyncio.run(run())


@pytest.mark.parametrize("body", [b"", b"swarmlm-frames/%d\n\x01" % (PROTOCOL_VERSION - 1), frames.MAGIC,
                                  frames.MAGIC + b"\x07", frames.MAGIC + b"\x01\xff\xfe"])
def test_bad_hellos_are_refused(body):
    with pytest.raises(FrameError):
        frames.parse_hello(body)


@pytest.mark.slow
def test_framed_streams_and_framed_pushes_generate_exactly_and_fail_over(tiny_bloom):
    """Framed streams and pushes (the defaults, named): greedy tokens equal transformers', pushed through
    the chain on the framed ports; a server killed mid-session is failed over to its replica."""
    import torch

    from swarmlm.types import BlockRange
    from tests.swarm_helpers import client_of, greedy_reference, server_processes

    ids, want = greedy_reference(tiny_bloom, "frames all the way", 6)
    ranges = [BlockRange(0, 3), BlockRange(3, 6), BlockRange(3, 6)]
    with server_processes(tiny_bloom, ranges, dht=False, server_args=["--push-frames"]) as swarm:
        client = client_of(swarm, frames=True, push=True, ban_base_s=0.1)
        try:
            with torch.no_grad(), client.inference_session(max_length=ids.shape[1] + 8) as session:
                logits = client.step_logits(session, ids)
                got = [int(logits[0, -1].argmax())]
                for i in range(5):
                    if i == 2:  # the replica of [3, 6) the session uses dies: failover to the other one
                        used = session.spans[-1].span.address
                        swarm.kill(next(s for s in swarm.servers[1:] if s.address == used))
                    logits = client.step_logits(session, torch.tensor([[got[-1]]]))
                    got.append(int(logits[0, -1].argmax()))
            assert got == want
            assert client.remote.channels.frame_ports, "the client did not use the framed ports"
            assert any(h.pushed for step in session.steps for h in step.hops), "nothing was pushed"
            assert any(step.pushed and step.blocking for step in session.steps), \
                "no pushed decode step ran from the caller's thread"
        finally:
            client.close()


def test_decode_steps_run_from_the_callers_thread_and_fail_over(tiny_bloom):
    """Framed, not pushed: every decode step runs from the caller's thread (no hand-off to the client's loop), a
    server killed mid-session is failed over (the rest of that step in the loop), and the tokens equal
    transformers'; a gRPC client's steps never take that path."""
    import torch

    from swarmlm.types import BlockRange
    from tests.swarm_helpers import client_of, greedy_reference, server_processes

    ids, want = greedy_reference(tiny_bloom, "the caller's own thread", 6)
    ranges = [BlockRange(0, 3), BlockRange(3, 6), BlockRange(3, 6)]
    with server_processes(tiny_bloom, ranges, dht=False) as swarm:
        clients = {framed: client_of(swarm, frames=framed, push=False, ban_base_s=0.1) for framed in (True, False)}
        try:
            for framed, client in clients.items():
                with torch.no_grad(), client.inference_session(max_length=ids.shape[1] + 8) as session:
                    logits = client.step_logits(session, ids)
                    got = [int(logits[0, -1].argmax())]
                    for i in range(5):
                        if framed and i == 2:  # the replica of [3, 6) the session uses dies mid-session
                            used = session.spans[-1].span.address
                            swarm.kill(next(s for s in swarm.servers[1:] if s.address == used))
                        logits = client.step_logits(session, torch.tensor([[got[-1]]]))
                        got.append(int(logits[0, -1].argmax()))
                assert got == want
                decode = session.steps[1:]
                assert [step.blocking for step in decode] == [framed] * 5
                if framed:
                    assert sum(step.failovers for step in decode) == 1
        finally:
            for client in clients.values():
                client.close()


def test_sessions_share_a_kept_framed_connection_and_one_the_server_closed_is_replaced(tiny_bloom):
    """A client keeps a framed connection whose stream ended cleanly (client/channels.py) and its next session
    starts on it; one the server closed while idle (ServerConfig.frame_idle_timeout_s) is not used again; and a
    kept one that ends as the session opens on it is replaced by a new connection, once. Every session's tokens
    equal transformers'."""
    import socket
    import threading

    import torch

    from swarmlm.types import BlockRange
    from tests.swarm_helpers import client_of, greedy_reference, in_process_swarm, poll_until

    ids, want = greedy_reference(tiny_bloom, "one connection, many sessions", 3)
    with in_process_swarm(tiny_bloom, [BlockRange(0, 6)], frame_idle_timeout_s=1.0) as swarm:
        server, address = swarm.servers[0], swarm.addresses[0]
        client = client_of(swarm, frames=True, push=False)
        channels = client.remote.channels

        def greedy() -> list[int]:
            with torch.no_grad():
                return client.generate(ids, max_new_tokens=3, do_sample=False)[0, ids.shape[1]:].tolist()

        def kept_port() -> int:
            (sock,) = channels._idle[address]
            return sock.getsockname()[1]

        try:
            assert greedy() == want
            first = kept_port()
            assert greedy() == want and kept_port() == first  # the second session ran on the same connection
            assert poll_until(lambda: not server._frames.connections, 30.0)  # closed by the server while idle
            assert greedy() == want and kept_port() != first
            # a kept connection that ends as it is taken: its peer reads the HELLO and closes
            with socket.create_server(("127.0.0.1", 0)) as closer:
                doomed = socket.create_connection(closer.getsockname())
                doomed.setblocking(False)
                peer, _ = closer.accept()
                heard: list[bytes] = []

                def hear_and_close() -> None:
                    with peer:
                        peer.settimeout(60.0)
                        heard.append(peer.recv(4096))

                closing = threading.Thread(target=hear_and_close)
                closing.start()
                channels._idle[address] = [doomed]
                assert greedy() == want  # (the open, cut on the kept connection, went again on a new one)
                closing.join(60.0)
            assert heard and heard[0][frames.HEADER.size:].startswith(frames.MAGIC)  # the session began there
            assert channels._idle[address][0] is not doomed
        finally:
            client.close()


def test_a_full_framed_port_closes_its_longest_idle_connection_for_a_newcomer(tiny_bloom):
    """Connections kept between streams never keep anyone out: with the port full (--max-concurrent-rpcs 2, both
    connections idle after a clean stream), a new connection is served and the oldest idle one is closed; with the
    port full of live streams, a newcomer is refused with RESOURCE_EXHAUSTED."""
    import socket

    from swarmlm.bench.frame_attacks import END, HELLO, exchange, frame_port, open_request
    from swarmlm.types import BlockRange
    from tests.swarm_helpers import in_process_server, poll_until

    with in_process_server(tiny_bloom, BlockRange(0, 2), max_concurrent_rpcs=2) as server:
        host, port = "127.0.0.1", frame_port(server.address)

        def connection(data: bytes, statuses: int) -> socket.socket:
            sock = socket.create_connection((host, port), timeout=60.0)
            sock.sendall(data)
            got = b""
            while got.count(frames.status(grpc.StatusCode.OK)) < statuses:
                got += sock.recv(1 << 16)
            return sock

        with connection(HELLO + open_request(2) + END, 1) as oldest, connection(HELLO + open_request(2) + END, 1):
            assert poll_until(lambda: len(server._frames.idle) == 2, 30.0)
            assert exchange(host, port, HELLO + open_request(2) + END, half_close=True) == ["REPLY", "STATUS OK "]
            assert oldest.recv(1) == b""  # closed by the server, without a word
        with connection(HELLO + open_request(2), 0), connection(HELLO + open_request(2), 0):  # two live streams
            assert poll_until(lambda: len(server._frames.connections) == 2 and not server._frames.idle, 30.0)
            answers = exchange(host, port, HELLO + open_request(2), half_close=True)
            assert answers[-1].startswith("STATUS RESOURCE_EXHAUSTED"), answers


def _client_end(peer_bytes: bytes, close: bool = True):
    """A FrameCall on one end of a socket pair whose other end sent `peer_bytes` (then closed)."""
    import socket

    from swarmlm.client.frame_call import FrameCall

    mine, theirs = socket.socketpair()
    mine.setblocking(False)
    theirs.sendall(peer_bytes)
    if close:
        theirs.close()
    return FrameCall(mine, 1024), theirs


@pytest.mark.parametrize("blocking", [True, False])
def test_a_write_after_the_servers_refusal_is_that_refusal_not_a_lost_connection(blocking):
    """A server that refused (STATUS, then closed) before the client's request went out: the failed write reports
    the refusal the server sent (here RESOURCE_EXHAUSTED, a full port), not UNAVAILABLE "connection lost"."""
    call, _ = _client_end(frames.status(grpc.StatusCode.RESOURCE_EXHAUSTED, "more than 2 connections"))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        if blocking:
            call.write_blocking(pb.InferenceRequest(), 5.0)
        else:
            asyncio.run(call.write(pb.InferenceRequest()))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "more than 2" in err.value.details()
    call.cancel()


@pytest.mark.parametrize("data, code, reason", [
    (HEADER.pack(5000, Kind.REPLY), grpc.StatusCode.INTERNAL, "oversized frame"),
    (HEADER.pack(1, 99) + b"x", grpc.StatusCode.INTERNAL, "unknown frame kind 99"),
    (HEADER.pack(10, Kind.REPLY) + b"abc", grpc.StatusCode.INTERNAL, "inside a frame"),
    (frames.frame(Kind.PUSH, b""), grpc.StatusCode.INTERNAL, "PUSH frame inside a stream"),
    (frames.frame(Kind.REPLY, b"\xff\xff\xff"), grpc.StatusCode.INTERNAL, "does not parse"),
    (frames.status(grpc.StatusCode.NOT_FOUND, "no such session"), grpc.StatusCode.NOT_FOUND, "no such session"),
    (b"", grpc.StatusCode.UNAVAILABLE, "closed without a status"),
])
def test_a_hostile_server_is_a_one_line_rpc_error_on_the_blocking_path(data, code, reason):
    call, _ = _client_end(data)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        call.read_blocking(5.0)
    assert err.value.code() == code and reason in err.value.details()
    call.cancel()


def test_a_pushed_step_waits_for_the_last_reply_or_a_broken_middle_stream():
    """FrameCall.wait_last: a middle server's reply does not wake the caller, the last one's does; a middle stream
    that ends does (its server broke or refused the step); nothing within the timeout is False."""
    middle, middle_peer = _client_end(b"", close=False)
    last, last_peer = _client_end(b"", close=False)
    from swarmlm.client.frame_call import FrameCall

    try:
        assert not FrameCall.wait_last([middle, last], 0.05)
        middle_peer.sendall(frames.frame(Kind.REPLY, b""))
        assert not FrameCall.wait_last([middle, last], 0.05)  # (a middle reply is read after the last one)
        last_peer.sendall(frames.frame(Kind.REPLY, b""))
        assert FrameCall.wait_last([middle, last], 5.0)
        assert last.read_blocking(1.0) == pb.InferenceReply() and middle.read_blocking(1.0) == pb.InferenceReply()
        assert not FrameCall.wait_last([middle, last], 0.05)
        middle_peer.close()
        assert FrameCall.wait_last([middle, last], 5.0)
    finally:
        for end in (middle, last):
            end.cancel()
        last_peer.close()


def test_blocking_reads_take_frames_in_order_and_time_out():

    replies = [pb.InferenceReply(step_id=i, position=i) for i in (1, 2)]
    call, peer = _client_end(b"".join(frames.frame(Kind.REPLY, r.SerializeToString()) for r in replies), close=False)
    assert [call.read_blocking(5.0).step_id for _ in replies] == [1, 2]
    with pytest.raises(TimeoutError):
        call.read_blocking(0.05)  # nothing more sent
    peer.sendall(frames.status(grpc.StatusCode.OK))
    assert call.read_blocking(5.0) is grpc.aio.EOF
    call.cancel()
    peer.close()



def test_a_pushing_server_takes_only_a_signed_frame_port():
    """A pushing server asks its target's Info with a fresh nonce and takes the framed port only when the target
    signed it (server/frame_push.py): an Info whose port differs from the one signed (a hostile answer, or one
    tampered with on the way), an unsigned one, or a signature over another nonce (a replayed answer) means gRPC
    pushes (port 0)."""
    from swarmlm.server.frame_push import FramePushes
    from swarmlm.swarm.identity import Identity, sign_info

    identity = Identity.generate()
    old_nonce = b"n" * 16

    def signed(nonce: bytes, port: int, signed_port: int) -> pb.InfoReply:
        reply = pb.InfoReply(server_id=identity.server_id, model="m", frame_port=signed_port)
        sign_info(identity, reply, nonce, "127.0.0.1:5000")
        reply.frame_port = port
        return reply

    answers = {
        "honest:1": lambda nonce: signed(nonce, 40001, 40001),
        "wrong-port:1": lambda nonce: signed(nonce, 22, 40001),
        "unsigned:1": lambda nonce: pb.InfoReply(server_id=identity.server_id, frame_port=40001),
        "replayed:1": lambda nonce: signed(old_nonce, 40001, 40001),
        "silent:1": lambda nonce: None,
    }
    nonces = []

    async def info(address: str, nonce: bytes) -> pb.InfoReply | None:
        nonces.append(nonce)
        return answers[address](nonce)

    async def ports() -> dict[str, int]:
        pushes = FramePushes(info, None, 1 << 20)
        return {address: await pushes.port(address) for address in answers}

    assert asyncio.run(ports()) == {"honest:1": 40001, "wrong-port:1": 0, "unsigned:1": 0, "replayed:1": 0,
                                    "silent:1": 0}
    assert len(set(nonces)) == len(answers) and old_nonce not in nonces  # a fresh challenge each time


def _frames_until_close(host: str, port: int, data: bytes, half_close: bool) -> list[tuple[Kind, bytes]]:
    """Send `data` on a new connection, then every frame the server sends until it closes."""
    import socket

    got, buf = [], bytearray()
    with socket.create_connection((host, port), timeout=60) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        while chunk := sock.recv(1 << 16):
            buf += chunk
            while (frame := frames.parse_frame(buf, 1 << 24)) is not None:
                got.append(frame)
    return got


def test_a_stream_sent_faster_than_its_inbox_takes_it_is_answered_in_order(tiny_bloom):
    """Frames go from the socket straight into the session's inbox (server/frame_server.py FramedRequests.feed);
    a client that writes 12 steps at once, more than the inbox (2) and its bytes in flight (3 steps) take, is held
    back (reading pauses) and answered in order, every step; a frame that stalls mid-body ends its stream with a
    one-line STATUS."""
    import torch

    from swarmlm.bench.frame_attacks import HELLO, frame_port, open_request
    from swarmlm.types import BlockRange
    from swarmlm.wire import codec
    from tests.swarm_helpers import in_process_server

    hidden = 64  # tiny-bloom's

    def step(step_id: int) -> bytes:
        request = pb.InferenceRequest(step=pb.InferenceStep(hidden=codec.encode(torch.randn(1, 1, hidden)),
                                                            step_id=step_id))
        return frames.frame(Kind.REQUEST, request.SerializeToString())

    step_bytes = 4 * hidden  # float32 payload of one step
    with in_process_server(tiny_bloom, BlockRange(0, 2), inbox_steps=2, max_peer_bytes_in_flight=3 * step_bytes,
                           session_idle_timeout_s=2.0, open_idle_timeout_s=10.0) as server:
        host, port = "127.0.0.1", frame_port(server.address)
        stalled = HELLO + HEADER.pack(100, Kind.REQUEST) + b"x" * 10  # (the session's 10 s to open comes later)
        burst = HELLO + open_request(2) + b"".join(step(i) for i in range(1, 13)) + frames.frame(Kind.END)
        got = _frames_until_close(host, port, burst, half_close=True)
        assert [k for k, _ in got] == [Kind.REPLY] * 13 + [Kind.STATUS]
        replies = [pb.InferenceReply.FromString(body) for _, body in got[1:-1]]
        assert [r.step_id for r in replies] == list(range(1, 13)), [r.error.message for r in replies]
        assert not any(r.error.code for r in replies), [r.error.message for r in replies]
        assert [r.position for r in replies] == list(range(1, 13))
        assert frames.parse_status(got[-1][1]) == (grpc.StatusCode.OK, "")
        # the next stream sent at once behind the first one's END, on the same connection: held back the same way,
        # then served in turn (frames read past the END are the next stream's)
        got = _frames_until_close(host, port, burst + burst, half_close=True)
        assert [k for k, _ in got] == ([Kind.REPLY] * 13 + [Kind.STATUS]) * 2
        assert frames.parse_status(got[-1][1]) == (grpc.StatusCode.OK, "")
        status = _frames_until_close(host, port, stalled, half_close=False)
        assert [k for k, _ in status] == [Kind.STATUS] and frames.parse_status(status[0][1]) == (
            grpc.StatusCode.INVALID_ARGUMENT, "a frame of 100 bytes did not arrive within 2.0 s")
        assert server.service.load.held == {}  # every step's bytes released


def test_bytes_in_flight_wake_a_waiting_add_and_no_one_else():
    """PeerBytes (server/sessions.py): an add that does not fit waits until a release makes room; a release with no
    add waiting starts no wake-up task (it ran after every step's reply, on both transports)."""
    from swarmlm.server.sessions import PeerBytes

    async def run() -> tuple[int, bool, bool, dict]:
        load = PeerBytes(100)
        await load.add("a", 60)
        tasks = len(asyncio.all_tasks())
        load.release("a", 60)  # nobody waits
        quiet = len(asyncio.all_tasks()) - tasks
        await load.add("a", 60)
        waiting = asyncio.ensure_future(load.add("a", 60))  # 120 > 100: waits
        await asyncio.sleep(0.01)
        blocked = not waiting.done()
        load.release("a", 60)
        await asyncio.wait_for(waiting, 5)
        return quiet, blocked, waiting.done(), dict(load.held)

    assert asyncio.run(run()) == (0, True, True, {"a": 60})


def test_a_refused_client_still_sending_reads_the_refusal_and_a_clean_end(tiny_bloom):
    """A refusal is a STATUS, then a close that does not reset the connection: a client whose request crosses the
    refusal (sent after the server said RESOURCE_EXHAUSTED and closed its side) still gets that STATUS and a clean
    end, not a reset (which a kernel answers by discarding what the client had not read yet). Also through the
    client's own FrameCall: the refusal is the RESOURCE_EXHAUSTED it is, not a lost connection."""
    import select
    import socket

    from swarmlm.bench.frame_attacks import HELLO, frame_port, open_request
    from swarmlm.client.frame_call import FrameCall
    from swarmlm.types import BlockRange
    from tests.swarm_helpers import in_process_server, poll_until

    with in_process_server(tiny_bloom, BlockRange(0, 2), max_concurrent_rpcs=2) as server:
        host, port = "127.0.0.1", frame_port(server.address)
        live = [socket.create_connection((host, port), timeout=60.0) for _ in range(2)]
        for sock in live:
            sock.sendall(HELLO + open_request(2))
        assert poll_until(lambda: len(server._frames.connections) == 2 and not server._frames.idle, 30.0)
        refusal = frames.status(grpc.StatusCode.RESOURCE_EXHAUSTED, "more than 2 connections")
        for _ in range(3):
            with socket.create_connection((host, port), timeout=60.0) as late:
                got = b""
                while chunk := late.recv(1 << 16):  # the refusal, then the server's side closed: EOF
                    got += chunk
                assert got == refusal
                late.sendall(HELLO + open_request(2))  # crossing the refusal
                late.shutdown(socket.SHUT_WR)
                assert late.recv(1 << 16) == b""  # a clean end: ConnectionResetError on a reset
            with socket.create_connection((host, port), timeout=60.0) as sock:
                sock.setblocking(False)
                call = FrameCall(sock, 1 << 20)
                hangup = select.poll()
                hangup.register(sock, select.POLLRDHUP)
                assert poll_until(lambda: hangup.poll(0), 30.0)  # the refusal came, and the server's side closed
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    call.write_blocking(pb.InferenceRequest(), 30.0)
                    call.write_blocking(pb.InferenceRequest(), 30.0)
                    call.read_blocking(30.0)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
                call.cancel()
        # closing connections count as closing, not as connections; each is cut at its bound, in time or in bytes
        frame_server = server._frames
        for linger_s, flood in ((0.5, False), (3600.0, True)):
            frame_server.linger_s = linger_s
            with socket.create_connection((host, port), timeout=60.0) as late:
                while late.recv(1 << 16):
                    pass
                assert poll_until(lambda: len(frame_server.lingering) == 1 and len(frame_server.connections) == 2,
                                  30.0)
                if flood:  # more than LINGER_BYTES after the refusal: cut at once (not after an hour)
                    try:
                        late.sendall(b"x" * (2 * frame_server.linger_bytes))
                    except ConnectionError:
                        pass
                assert poll_until(lambda: not frame_server.lingering, 30.0)  # (a silent peer never ends its side)
        for sock in live:
            sock.close()


def test_a_blocking_read_sleeps_until_the_reply_then_reads_it_once():
    """read_blocking waits in poll() before it reads: a reply that comes later is taken with one recv, none that
    fails for want of bytes (a raised BlockingIOError is one more cold call per decode step). A cancelled call's
    read is UNAVAILABLE without a wait."""
    import socket
    import threading

    from swarmlm.client.frame_call import FrameCall

    class CountingSocket(socket.socket):
        recvs = 0

        def recv(self, *args):
            CountingSocket.recvs += 1
            return super().recv(*args)

    raw, peer = socket.socketpair()
    mine = CountingSocket(fileno=raw.detach())
    mine.setblocking(False)
    call = FrameCall(mine, 1024)
    reply = pb.InferenceReply(step_id=3)
    later = threading.Timer(0.1, peer.sendall, [frames.frame(Kind.REPLY, reply.SerializeToString())])
    later.start()
    try:
        assert call.read_blocking(5.0) == reply
        assert CountingSocket.recvs == 1
        call.cancel()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            call.read_blocking(5.0)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        later.join()
        call.cancel()
        peer.close()
