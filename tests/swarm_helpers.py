"""Helpers for tests that talk to real server processes."""
from __future__ import annotations

import queue

from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire import swarm_pb2_grpc as pb_grpc
from swarmlm.wire.channel import sync_channel


class RawStream:
    """A bidirectional Inference stream driven step by step from a test (sync gRPC)."""

    def __init__(self, address: str, max_message_bytes: int = 256 << 20) -> None:
        self.channel = sync_channel(address, max_message_bytes)
        self.stub = pb_grpc.SwarmStub(self.channel)
        self.requests: queue.Queue = queue.Queue()
        self.replies = self.stub.Inference(iter(self.requests.get, None), timeout=60)

    def send(self, request: pb.InferenceRequest) -> pb.InferenceReply:
        self.requests.put(request)
        return next(self.replies)

    def close(self) -> None:
        self.requests.put(None)
        self.channel.close()


def stub(address: str) -> pb_grpc.SwarmStub:
    return pb_grpc.SwarmStub(sync_channel(address))
