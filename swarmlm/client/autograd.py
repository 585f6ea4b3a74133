"""Training through the swarm, the client's side: each span of a route as a `torch.autograd.Function`.

Forward sends the span's input to its server (the stateless Forward RPC) and keeps the input; backward sends the
input and the output's gradient (Backward RPC) and gets the input's gradient back, with those of the deep prompts
and LoRA matrices that travelled with the request. Servers keep nothing between the two, so a server that dies
in between costs a re-route: its blocks go to other servers, which recompute the forward (a chain of several
spans forwards through its first ones to get their inputs) and then run the backward (docs/FINETUNING.md).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
import torch

from swarmlm.client.remote import RemoteSequence
from swarmlm.errors import InvalidRequest, ServerFailed
from swarmlm.types import Span
from swarmlm.wire import codec, compress
from swarmlm.wire import swarm_pb2 as pb

log = logging.getLogger(__name__)
CLIENT_ERRORS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)  # the request's fault


@dataclass(frozen=True)
class LoraSpec:
    """One LoRA'd linear layer: where, and its scale (alpha / r); its matrices are tensors passed alongside."""

    block: int
    module: str
    scale: float


@dataclass(frozen=True)
class SpanCall:
    """What is fixed for one span of one forward: blocks [start, end), the rows' padding mask and the LoRA layers
    in this range (their matrices are the Function's tensor inputs, a and b per layer, in this order)."""

    start: int
    end: int
    mask: torch.Tensor  # [B, T]
    lora: tuple[LoraSpec, ...] = ()


@dataclass
class Grads:
    hidden: torch.Tensor
    prompts: torch.Tensor | None  # [end - start, B, K, H]
    lora: list[torch.Tensor]  # a, b per LoraSpec


class RemoteTrainer:
    """Forward and backward RPCs over ranges of blocks, with re-routing around failed servers."""

    def __init__(self, remote: RemoteSequence) -> None:
        self.remote = remote
        self.config = remote.config
        self.last_spans: list[Span] = []  # the servers the latest forward of a range ran on (stats, tests)
        self.bytes_sent = 0  # serialized requests and replies of every training RPC so far
        self.bytes_received = 0

    # ---- one RPC ------------------------------------------------------------------------------------------
    def _encode(self, span: Span, tensor: torch.Tensor) -> pb.Tensor:
        fmt = self.remote.channels.wire_dtype_for(span.address, tensor.numel() * 4)
        return compress.encode_hidden(tensor.detach().float(), fmt)

    def _extras(self, call: SpanCall, span: Span, prompts, lora) -> tuple[pb.Tensor | None, list[pb.LoraWeights]]:
        p = None
        if prompts is not None:
            p = codec.encode(prompts[span.start - call.start:span.end - call.start].detach().float())
        weights = [pb.LoraWeights(block=s.block, module=s.module, scale=s.scale, a=codec.encode(a.detach().float()),
                                  b=codec.encode(b.detach().float()))
                   for s, a, b in zip(call.lora, lora[0::2], lora[1::2]) if span.start <= s.block < span.end]
        return p, weights

    async def _rpc(self, span: Span, method: str, request):
        try:
            stub = self.remote.channels.stub(span.address)
            reply = await getattr(stub, method)(request, timeout=self.config.step_timeout_s)
            self.bytes_sent += request.ByteSize()
            self.bytes_received += reply.ByteSize()
            return reply
        except grpc.aio.AioRpcError as exc:
            if exc.code() in CLIENT_ERRORS:
                raise InvalidRequest(f"{span.address} refused the {method}: {exc.details()}") from None
            raise ServerFailed(span.server_id, f"{method}: {exc.code().name}: {exc.details()}") from None
        except (OSError, asyncio.TimeoutError) as exc:
            raise ServerFailed(span.server_id, f"{method}: {type(exc).__name__}: {exc}") from None

    async def forward_span(self, call: SpanCall, span: Span, hidden, prompts, lora) -> torch.Tensor:
        p, weights = self._extras(call, span, prompts, lora)
        request = pb.ForwardRequest(start_block=span.start, end_block=span.end, hidden=self._encode(span, hidden),
                                    attention_mask=codec.encode(call.mask), lora=weights)
        if p is not None:
            request.prompts.CopyFrom(p)
        reply = await self._rpc(span, "Forward", request)
        return self._decode(span, reply.hidden, hidden.shape, "hidden")

    async def backward_span(self, call: SpanCall, span: Span, hidden, grad, prompts, lora) -> Grads:
        p, weights = self._extras(call, span, prompts, lora)
        request = pb.BackwardRequest(start_block=span.start, end_block=span.end, hidden=self._encode(span, hidden),
                                     attention_mask=codec.encode(call.mask), grad_output=self._encode(span, grad),
                                     lora=weights)
        if p is not None:
            request.prompts.CopyFrom(p)
        reply = await self._rpc(span, "Backward", request)
        grad_hidden = self._decode(span, reply.grad_hidden, hidden.shape, "grad_hidden")
        grad_prompts = None
        if p is not None:
            grad_prompts = self._decode(span, reply.grad_prompts, tuple(p.shape), "grad_prompts")
        if len(reply.grad_lora) != len(weights):
            raise ServerFailed(span.server_id, f"Backward: {len(reply.grad_lora)} LoRA gradients for {len(weights)}")
        lora_grads = []
        for w, g in zip(weights, reply.grad_lora):
            lora_grads += [self._decode(span, g.a, tuple(w.a.shape), "lora.a"),
                           self._decode(span, g.b, tuple(w.b.shape), "lora.b")]
        return Grads(grad_hidden, grad_prompts, lora_grads)

    @staticmethod
    def _decode(span: Span, msg: pb.Tensor, shape, what: str) -> torch.Tensor:
        """A server's tensor of the shape asked for (a wrong one is that server's failure)."""
        try:
            tensor = codec.decode(msg, what, max_elements=max(1, int(torch.Size(shape).numel())), finite=True)
        except InvalidRequest as exc:
            raise ServerFailed(span.server_id, f"malformed reply: {exc}") from None
        if tuple(tensor.shape) != tuple(shape):
            raise ServerFailed(span.server_id, f"{what}: shape {list(tensor.shape)}, expected {list(shape)}")
        return tensor.float()

    # ---- ranges, with failover ---------------------------------------------------------------------------
    def route(self, start: int, end: int, rows: int, n_tokens: int, refresh: bool = False) -> list[Span]:
        return list(self.remote.route(start, end, n_tokens, 1, rows, n_tokens, refresh=refresh).spans)

    async def _forward_chain(self, call, spans, hidden, prompts, lora) -> list[torch.Tensor]:
        inputs = [hidden]
        for span in spans:
            inputs.append(await self.forward_span(call, span, inputs[-1], prompts, lora))
        return inputs

    async def _backward_chain(self, call, spans, inputs, grad, prompts, lora) -> Grads:
        prompt_grads, lora_grads = [], {}
        for i in reversed(range(len(spans))):
            grads = await self.backward_span(call, spans[i], inputs[i], grad, prompts, lora)
            grad = grads.hidden
            prompt_grads.insert(0, grads.prompts)
            mine = [j for j, s in enumerate(call.lora) if spans[i].start <= s.block < spans[i].end]
            for j, (ga, gb) in zip(mine, zip(grads.lora[0::2], grads.lora[1::2])):
                lora_grads[j] = (ga, gb)
        flat = []
        for j, spec in enumerate(call.lora):
            flat += list(lora_grads[j])
        return Grads(grad, torch.cat(prompt_grads) if prompts is not None else None, flat)

    def _with_failover(self, call: SpanCall, spans: list[Span], run):
        """run(spans) on the loop; on a server's failure: ban it, re-route [start, end), run again (bounded)."""
        failures = 0
        while True:
            try:
                return self.remote.loop.run(run(spans)), spans
            except ServerFailed as exc:
                failures += 1
                if failures > self.config.max_retries:
                    raise
                log.warning("training: %s; re-routing blocks [%d, %d)", exc, call.start, call.end)
                self.remote.view.ban(exc.server_id)
                rows, n_tokens = call.mask.shape
                spans = self.route(call.start, call.end, rows, n_tokens, refresh=True)

    def forward(self, call: SpanCall, spans: list[Span], hidden, prompts, lora):
        """The range's output, the spans that computed it and their inputs."""
        inputs, spans = self._with_failover(
            call, spans, lambda s: self._forward_chain(call, s, hidden, prompts, lora))
        self.last_spans = spans
        return inputs[-1], spans, inputs[:-1]

    def backward(self, call: SpanCall, spans: list[Span], inputs: list[torch.Tensor], grad, prompts, lora) -> Grads:
        first = {"spans": spans}

        async def run(chain: list[Span]) -> Grads:
            # the chain that ran the forward has its inputs; a new one recomputes them first
            known = inputs if chain is first["spans"] else (
                await self._forward_chain(call, chain[:-1], inputs[0], prompts, lora))
            return await self._backward_chain(call, chain, known, grad, prompts, lora)

        grads, _ = self._with_failover(call, spans, run)
        return grads


class SpanFunction(torch.autograd.Function):
    """One span of the route (blocks [call.start, call.end)) as an autograd node: differentiable in its input
    hidden states, its deep prompts and its LoRA matrices."""

    @staticmethod
    def forward(ctx, trainer: RemoteTrainer, call: SpanCall, spans: list[Span], hidden: torch.Tensor,
                prompts: torch.Tensor | None, *lora: torch.Tensor) -> torch.Tensor:
        lora_values = [t.detach() for t in lora]
        prompt_values = prompts.detach() if prompts is not None else None
        out, used, inputs = trainer.forward(call, spans, hidden.detach(), prompt_values, lora_values)
        ctx.trainer, ctx.call, ctx.spans, ctx.inputs = trainer, call, used, inputs
        ctx.prompts, ctx.lora = prompt_values, lora_values
        return out.to(hidden.dtype)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grads = ctx.trainer.backward(ctx.call, ctx.spans, ctx.inputs, grad_output.float(), ctx.prompts, ctx.lora)
        ctx.inputs = None  # (the graph may be kept: retain_graph; the inputs are no longer needed)
        return (None, None, None, grads.hidden, grads.prompts, *grads.lora)


def run_route(trainer: RemoteTrainer, hidden: torch.Tensor, mask: torch.Tensor, prompts: torch.Tensor | None,
              lora: list[tuple[LoraSpec, torch.Tensor, torch.Tensor]], num_blocks: int) -> torch.Tensor:
    """hidden [B, T, H] through blocks [0, num_blocks), one autograd node per span of the route.
    prompts: [num_blocks, B, K, H] or None; lora: (spec, a, b) per LoRA'd layer."""
    rows, n_tokens = mask.shape
    for span in trainer.route(0, num_blocks, rows, n_tokens):
        mine = [(s, a, b) for s, a, b in lora if span.start <= s.block < span.end]
        call = SpanCall(span.start, span.end, mask, tuple(s for s, _, _ in mine))
        part = prompts[span.start:span.end] if prompts is not None else None
        tensors = [t for _, a, b in mine for t in (a, b)]
        hidden = SpanFunction.apply(trainer, call, [span], hidden, part, *tensors)
    return hidden
