"""Driving a live server from outside, shared by the attack suite (benchmarks/attacks.py) and the tests: an Inference
stream written message by message (`RawStream`: what a hostile or hand-written peer sends), and an honest client's
greedy steps (`greedy_steps`, `greedy_tokens`: what must still come out right, compared with plain transformers)."""
from __future__ import annotations

import queue
import time
from typing import Iterator

import torch

from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire import swarm_pb2_grpc as pb_grpc
from swarmlm.wire.channel import sync_channel


class RawStream:
    """A bidirectional Inference stream driven message by message (sync gRPC): `send` = write + read; `write` and
    `read` apart where replies come from elsewhere (a push). `end` is a clean end of the stream (the session closes),
    `drop` a broken one (a client that died). `target`: an address (the stream gets a channel of its own, closed
    with it) or a stub (streams sharing one connection, as one host opening many)."""

    def __init__(self, target: str | pb_grpc.SwarmStub, max_message_bytes: int = 256 << 20,
                 timeout_s: float = 120.0) -> None:
        self.channel = sync_channel(target, max_message_bytes) if isinstance(target, str) else None
        self.stub = pb_grpc.SwarmStub(self.channel) if self.channel is not None else target
        self.requests: queue.Queue = queue.Queue()
        self.replies = self.stub.Inference(iter(self.requests.get, None), timeout=timeout_s)

    @classmethod
    def open(cls, address: str, start: int, end: int, batch: int = 1,
             max_length: int = 32) -> tuple["RawStream", pb.InferenceReply]:
        """A stream whose first message opens a session of blocks [start, end), and the server's answer."""
        stream = cls(address)
        return stream, stream.send(open_request(start, end, batch, max_length))

    def write(self, request: pb.InferenceRequest) -> None:
        self.requests.put(request)

    def read(self) -> pb.InferenceReply:
        return next(self.replies)

    def send(self, request: pb.InferenceRequest) -> pb.InferenceReply:
        self.write(request)
        return self.read()

    def end(self) -> None:
        self.requests.put(None)
        if self.channel is not None:
            self.channel.close()

    def drop(self) -> None:
        self.replies.cancel()
        if self.channel is not None:
            self.channel.close()


def open_request(start: int, end: int, batch: int = 1, max_length: int = 32) -> pb.InferenceRequest:
    """The message that opens a session of blocks [start, end) for `batch` rows of up to `max_length` tokens."""
    return pb.InferenceRequest(open=pb.OpenSession(start_block=start, end_block=end, batch_size=batch,
                                                   max_length=max_length))


def greedy_steps(client, session, ids: torch.Tensor, steps: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Steps `session` of `client` (a DistributedModelForCausalLM) by hand: the prompt `ids` [B, T], then `steps`
    greedy decode steps (each row's argmax). Yields (the ids so far, that step's logits [B, new tokens, vocab])
    after each step, the prompt's first. (Call it under torch.no_grad().)"""
    logits = client.step_logits(session, ids)
    yield ids, logits
    for _ in range(steps):
        nxt = logits[:, -1:].argmax(-1)
        ids = torch.cat([ids, nxt], 1)
        logits = client.step_logits(session, nxt)
        yield ids, logits


def greedy_tokens(client, ids: torch.Tensor, new_tokens: int, step_latencies: list[float] | None = None) -> list[int]:
    """`new_tokens` greedy tokens after the prompt `ids` [1, T], stepped by hand in a session of their own (no eos
    stops them); each decode step's seconds appended to `step_latencies` if given."""
    with torch.no_grad(), client.inference_session(max_length=ids.shape[1] + new_tokens) as session:
        steps = greedy_steps(client, session, ids, new_tokens)
        seen, _ = next(steps)  # the prompt
        for _ in range(new_tokens):
            started = time.perf_counter()
            seen, _ = next(steps)
            if step_latencies is not None:
                step_latencies.append(time.perf_counter() - started)
    return seen[0, ids.shape[1]:].tolist()
