"""A private swarm's gate on the server: every call (Info, Forward, Inference streams, Push) must carry a valid
`x-swarmlm-auth` token (swarm/private.py); others are refused UNAUTHENTICATED before any handler runs."""
from __future__ import annotations

import logging

import grpc

from swarmlm.swarm.private import AUTH_HEADER, HINT, TokenChecker

log = logging.getLogger(__name__)


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only aborts the call."""

    async def abort(request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


class SwarmKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, swarm_key: bytes) -> None:
        self.checker = TokenChecker(swarm_key)
        self.refused = 0

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        token = next((v for k, v in details.invocation_metadata or () if k == AUTH_HEADER), None)
        reason = self.checker.check(details.method, token if isinstance(token, str) else None)
        handler = await continuation(details)
        if reason is None or handler is None:
            return handler
        self.refused += 1
        log.info("refused %s: %s", details.method, reason)
        return _refusal(handler, f"this server belongs to a private swarm ({reason}): {HINT}")


def server_interceptors(swarm_key: bytes | None) -> list[grpc.aio.ServerInterceptor]:
    """For `grpc.aio.server(interceptors=...)`: none in an open swarm."""
    return [] if swarm_key is None else [SwarmKeyInterceptor(swarm_key)]
