"""An Inference stream over the framed step port (wire/frames.py), with the interface SpanStream uses of a grpc.aio
stream call (write, read, done_writing, cancel) and gRPC's errors (AioRpcError with a status code), so failover,
push, speculation and chunked prefill run unchanged on either transport."""
from __future__ import annotations

import asyncio

import grpc

from swarmlm.swarm.private import make_token
from swarmlm.wire import frames
from swarmlm.wire import swarm_pb2 as pb
from swarmlm.wire.frames import FrameError, Kind, Purpose

INFERENCE_METHOD = "/swarmlm.Swarm/Inference"


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class FrameCall:
    """One Inference stream on its own connection. Reads give InferenceReplies, then grpc.aio.EOF at the server's
    OK, or raise AioRpcError with the server's status (or UNAVAILABLE when the connection breaks)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_message_bytes: int) -> None:
        self._reader, self._writer = reader, writer
        self._max = max_message_bytes
        self._status: tuple[grpc.StatusCode, str] | None = None  # the stream's end, once read
        self._writing_done = False

    @classmethod
    async def open(cls, host: str, port: int, swarm_key: bytes | None, max_message_bytes: int,
                   timeout_s: float) -> "FrameCall":
        token = make_token(swarm_key, INFERENCE_METHOD) if swarm_key is not None else None
        reader, writer = await frames.connect(host, port, Purpose.STREAM, token, timeout_s)
        return cls(reader, writer, max_message_bytes)

    async def write(self, request: pb.InferenceRequest) -> None:
        if self._writing_done or self._writer.is_closing():
            raise asyncio.InvalidStateError("the stream is closed for writing")
        try:
            self._writer.write(frames.frame(Kind.REQUEST, request.SerializeToString()))
            await self._writer.drain()
        except ConnectionError as exc:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"connection lost: {exc}") from None

    async def read(self):
        """The next reply, or grpc.aio.EOF after the server's OK."""
        if self._status is not None:
            return self._end()
        try:
            got = await frames.read_frame(self._reader, self._max)
        except FrameError as exc:
            self.cancel()
            raise rpc_error(grpc.StatusCode.INTERNAL, f"the server broke the framing: {exc}") from None
        except ConnectionError as exc:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"connection lost: {exc}") from None
        if got is None:
            self._status = (grpc.StatusCode.UNAVAILABLE, "the connection closed without a status")
            return self._end()
        kind, body = got
        if kind == Kind.REPLY:
            try:
                return pb.InferenceReply.FromString(body)
            except Exception:  # a hostile byte string
                self.cancel()
                raise rpc_error(grpc.StatusCode.INTERNAL, "a reply that does not parse") from None
        if kind == Kind.STATUS:
            self._status = frames.parse_status(body)
            return self._end()
        self.cancel()
        raise rpc_error(grpc.StatusCode.INTERNAL, f"the server sent a {kind.name} frame inside a stream")

    def _end(self):
        code, details = self._status
        if code == grpc.StatusCode.OK:
            return grpc.aio.EOF
        raise rpc_error(code, details)

    async def done_writing(self) -> None:
        if self._writing_done:
            return
        self._writing_done = True
        try:
            self._writer.write(frames.frame(Kind.END))
            await self._writer.drain()
        except ConnectionError:
            pass

    def cancel(self) -> None:
        self._writing_done = True
        self._writer.close()
