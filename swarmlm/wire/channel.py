"""gRPC options in one place: every channel (client, server-to-server push, tests) and the server agree on the
largest message, and a server never shares its port with another process."""
from __future__ import annotations

from typing import Sequence

import grpc

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    # no SO_REUSEPORT: two servers told to use one port must fail, not split its connections
    return channel_options(max_message_bytes) + [("grpc.so_reuseport", 0)]


def aio_channel(address: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                interceptors: Sequence = ()) -> grpc.aio.Channel:
    """`interceptors`: a private swarm's token on every call (swarm/private.client_interceptors)."""
    # reconnect within a second once the address answers again (a restarted server), not after gRPC's default
    # backoff, which grows to two minutes while the server is down
    options = channel_options(max_message_bytes) + [("grpc.initial_reconnect_backoff_ms", 250),
                                                     ("grpc.max_reconnect_backoff_ms", 1000)]
    return grpc.aio.insecure_channel(address, options=options, interceptors=list(interceptors) or None)


def sync_channel(address: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> grpc.Channel:
    return grpc.insecure_channel(address, options=channel_options(max_message_bytes))
