"""A peer's bytes as a request, or UNPARSABLE: gRPC (`add_to_server`) and the framed port (server/frame_server.py)
parse through `request_of` alike, so bytes which do not parse reach the handlers as one marker and get
INVALID_ARGUMENT (gRPC's own deserialization failure would be UNKNOWN)."""
from __future__ import annotations

import grpc

from swarmlm.wire import swarm_pb2 as pb

UNPARSABLE = object()  # what a message that does not parse becomes

# method -> (request type, reply type, streaming): the one table both transports parse by
METHODS = {
    "Inference": (pb.InferenceRequest, pb.InferenceReply, True),
    "Forward": (pb.ForwardRequest, pb.ForwardReply, False),
    "Backward": (pb.BackwardRequest, pb.BackwardReply, False),
    "Info": (pb.InfoRequest, pb.InfoReply, False),
    "Push": (pb.PushRequest, pb.PushReply, False),
}


def request_of(method: str, data: bytes):
    """The `method`'s request from a peer's `data`, or UNPARSABLE."""
    try:
        return METHODS[method][0].FromString(data)
    except Exception:  # DecodeError, or anything else a hostile byte string provokes
        return UNPARSABLE


def add_to_server(service, server) -> None:
    """Register `service` (server/service.SwarmService) like the generated add_SwarmServicer_to_server, its
    requests parsed by `request_of`."""

    def handler(method: str):
        _, reply_type, streaming = METHODS[method]
        make = grpc.stream_stream_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler
        # (Inference's replies come serialized, MAC and all: server/session_stream.py; gRPC sends bytes as they are)
        serialize = None if streaming else reply_type.SerializeToString
        return make(getattr(service, method), lambda data: request_of(method, data), serialize)

    handlers = {method: handler(method) for method in METHODS}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("swarmlm.Swarm", handlers),))
