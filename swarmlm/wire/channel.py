"""gRPC options in one place: every channel (client, server-to-server push, tests) and the server agree on the
largest message, and a server never shares its port with another process."""
from __future__ import annotations

from typing import Callable, Sequence

import grpc

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
# A server behind NAT is announced as "p2p/<libp2p peer id>" (docs/PROTOCOL.md, "Servers behind NAT"): channels to it
# go to a local port whose connections the P2P layer relays (swarm/reach.py Tunnels registers them here)
P2P_PREFIX = "p2p/"
_p2p_endpoints: dict[str, Callable[[str], str]] = {}  # p2p address -> (address -> local host:port)


def is_p2p_address(address: str) -> bool:
    return address.startswith(P2P_PREFIX)


def register_p2p_endpoint(address: str, endpoint: Callable[[str], str]) -> None:
    """Where new channels to a p2p address connect (the latest registration wins)."""
    _p2p_endpoints[address] = endpoint


def forget_p2p_endpoint(address: str, endpoint: Callable[[str], str]) -> None:
    """Undo `register_p2p_endpoint`, unless another registration has replaced it since."""
    if _p2p_endpoints.get(address) == endpoint:
        del _p2p_endpoints[address]


def _target(address: str) -> str:
    if not is_p2p_address(address):
        return address
    endpoint = _p2p_endpoints.get(address)
    if endpoint is None:  # a channel that cannot connect: its calls fail UNAVAILABLE, as a dead server's
        return "unix:/nonexistent/swarmlm-no-relay-route"
    return endpoint(address)


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    # no SO_REUSEPORT: two servers told to use one port must fail, not split its connections
    return channel_options(max_message_bytes) + [("grpc.so_reuseport", 0)]


def aio_channel(address: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                interceptors: Sequence = (), fresh: bool = False) -> grpc.aio.Channel:
    """`interceptors`: a private swarm's token on every call (swarm/private.client_interceptors). `fresh`: a
    connection of its own, made now. Without it gRPC shares connections between channels of one target and options
    (its global subchannel pool): a new channel may get a connection made earlier, or one still in the backoff after
    a failure, which fails its calls UNAVAILABLE at once. A check of what a connection reaches now needs `fresh`."""
    # reconnect within a second once the address answers again (a restarted server), not after gRPC's default
    # backoff, which grows to two minutes while the server is down
    options = channel_options(max_message_bytes) + [("grpc.initial_reconnect_backoff_ms", 250),
                                                     ("grpc.max_reconnect_backoff_ms", 1000)]
    if fresh:
        options.append(("grpc.use_local_subchannel_pool", 1))
    return grpc.aio.insecure_channel(_target(address), options=options, interceptors=list(interceptors) or None)


def sync_channel(address: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> grpc.Channel:
    return grpc.insecure_channel(_target(address), options=channel_options(max_message_bytes))
