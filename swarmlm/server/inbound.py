"""A peer's bytes as a message, or UNPARSABLE: gRPC (`add_to_server`) and the framed port (server/frame_server.py)
parse alike, so bytes which do not parse reach the handlers as one marker and get INVALID_ARGUMENT (gRPC's own
deserialization failure would be UNKNOWN)."""
from __future__ import annotations

import grpc

from swarmlm.wire import swarm_pb2 as pb

UNPARSABLE = object()  # what a message that does not parse becomes


def parse(message_type, data: bytes):
    """`message_type` from `data`, or UNPARSABLE."""
    try:
        return message_type.FromString(data)
    except Exception:  # DecodeError, or anything else a hostile byte string provokes
        return UNPARSABLE


def add_to_server(service, server) -> None:
    """Register `service` (server/service.SwarmService) like the generated add_SwarmServicer_to_server, its
    requests parsed by `parse`."""

    def parser(message_type):
        return lambda data: parse(message_type, data)

    handlers = {
        "Inference": grpc.stream_stream_rpc_method_handler(
            service.Inference, parser(pb.InferenceRequest), pb.InferenceReply.SerializeToString),
        "Forward": grpc.unary_unary_rpc_method_handler(
            service.Forward, parser(pb.ForwardRequest), pb.ForwardReply.SerializeToString),
        "Backward": grpc.unary_unary_rpc_method_handler(
            service.Backward, parser(pb.BackwardRequest), pb.BackwardReply.SerializeToString),
        "Info": grpc.unary_unary_rpc_method_handler(service.Info, parser(pb.InfoRequest),
                                                    pb.InfoReply.SerializeToString),
        "Push": grpc.unary_unary_rpc_method_handler(service.Push, parser(pb.PushRequest),
                                                    pb.PushReply.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("swarmlm.Swarm", handlers),))
