"""The training RPCs: Forward with deep prompts or a client's LoRA, and Backward (docs/PROTOCOL.md, "Training").

Everything a peer sends is checked from the message headers before any tensor is decoded (range, shapes, the
request's estimated memory against ServerConfig.max_train_request_bytes), then decoded with NaN/inf refused. A
refusal changes nothing: these calls keep no state. Compute goes to the scheduler one block at a time, as prefill
work, so other sessions' decode steps keep their priority between the blocks of a long backward.
"""
from __future__ import annotations

import asyncio
import math
import time
from typing import Callable

import torch

from swarmlm.config import ServerConfig
from swarmlm.errors import CapacityExceeded, InvalidRequest
from swarmlm.server import training
from swarmlm.server.checks import StepChecks, decode_step
from swarmlm.server.lora import LoraDelta
from swarmlm.server.scheduler import Batchable, JobTiming, Scheduler
from swarmlm.server.stage import Stage
from swarmlm.server.training import TrainRequest
from swarmlm.server.unary import Admission
from swarmlm.types import StepKind
from swarmlm.wire import codec, compress
from swarmlm.wire import swarm_pb2 as pb

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _call_each(items: list) -> list:
    return [item() for item in items]


def _float_header(msg: pb.Tensor, what: str, shape: tuple[int, ...]) -> None:
    dtype, got = codec.header(msg, what, max_elements=max(math.prod(shape), 1))
    if dtype not in FLOAT_DTYPES or got != shape:
        raise InvalidRequest(f"{what}: expected a float tensor {list(shape)}, got {dtype} {list(got)}")


def _message_bytes(request) -> int:
    """Bytes the request's tensors declare (headers only; 0 for a header that is invalid: refused later)."""
    msgs = [request.hidden, request.attention_mask, request.prompts]
    msgs += [getattr(request, "grad_output", pb.Tensor())] + [t for w in request.lora for t in (w.a, w.b)]
    total = 0
    for msg in msgs:
        try:
            _, shape = codec.header(msg) if codec.is_set(msg) else (None, ())
        except InvalidRequest:
            continue
        total += math.prod(shape) * 4 if shape else 0
    return total


def _decoded(weights: list[pb.LoraWeights]) -> tuple[LoraDelta, ...]:
    return tuple(LoraDelta(w.block, w.module, codec.decode(w.a, "lora.a", finite=True).float(),
                           codec.decode(w.b, "lora.b", finite=True).float(), float(w.scale)) for w in weights)


class TrainBudget:
    """The estimated memory of every training request admitted here, summed, stays within `total` bytes: a request
    that does not fit waits (at most `wait_s`) for others to finish, then is refused. `peak`: the largest sum held."""

    def __init__(self, total: int, wait_s: float) -> None:
        self.total, self.wait_s = total, wait_s
        self.used = self.peak = 0
        self._freed = asyncio.Condition()

    async def acquire(self, nbytes: int) -> bool:
        async with self._freed:
            if self.used + nbytes > self.total:
                try:
                    async with asyncio.timeout(self.wait_s):
                        await self._freed.wait_for(lambda: self.used + nbytes <= self.total)
                except TimeoutError:
                    return False
            self.used += nbytes
            self.peak = max(self.peak, self.used)
            return True

    async def release(self, nbytes: int) -> None:
        async with self._freed:
            self.used -= nbytes
            self._freed.notify_all()


class TrainingRpcs:
    """Forward-with-extras and Backward on the blocks `stage_of()` returns (the server replaces its stage when it
    moves to other blocks), computed through `scheduler`; `trim` hands freed heap back to the OS."""

    def __init__(self, config: ServerConfig, scheduler: Scheduler, stage_of: Callable[[], Stage],
                 trim: Callable[[], None]) -> None:
        self.config, self.scheduler, self._stage_of, self.trim = config, scheduler, stage_of, trim
        self.budget = TrainBudget(self.config.max_train_total_bytes, self.config.train_admission_wait_s)

    @property
    def stage(self) -> Stage:
        return self._stage_of()

    @property
    def checks(self) -> StepChecks:
        stage = self.stage
        return StepChecks(self.config, stage.blocks, stage.hidden_size)

    # ---- validation --------------------------------------------------------------------------------------
    def estimate(self, request) -> int:
        """The request's estimated peak memory here (headers only), or CapacityExceeded over the per-request bound."""
        blocks = self.checks.range(request.start_block, request.end_block)
        b, t = self.checks.shape(request.hidden, None, 0, self.config.max_length_tokens)
        need = training.backward_bytes(self.stage, blocks.length, b, t)
        if need > self.config.max_train_request_bytes:
            raise CapacityExceeded(
                f"{b} x {t} tokens over {blocks.length} blocks need ~{need >> 20} MiB here, over the "
                f"{self.config.max_train_request_bytes >> 20} MiB a training request may use: send fewer rows")
        return need

    def parse(self, request, with_grad: bool) -> tuple[TrainRequest, torch.Tensor | None]:
        """A TrainRequest (and the output gradient) from a Forward or Backward request, or InvalidRequest
        naming what is wrong (`estimate` checked its size first). Headers first, then the data."""
        checks, h = self.checks, self.stage.hidden_size
        blocks = checks.range(request.start_block, request.end_block)
        b, t = checks.shape(request.hidden, None, 0, self.config.max_length_tokens)
        if with_grad:
            _float_header(request.grad_output, "grad_output", (b, t, h))
        k = 0
        if codec.is_set(request.prompts):
            _, shape = codec.header(request.prompts, "prompts", max_elements=blocks.length * b * t * h)
            k = shape[2] if len(shape) == 4 else 0
            if not 1 <= k <= t:
                raise InvalidRequest(f"prompts: expected [{blocks.length}, {b}, K <= {t}, {h}], got {list(shape)}")
            _float_header(request.prompts, "prompts", (blocks.length, b, k, h))
        lora = self._lora_headers(request.lora, blocks)
        hidden, mask = decode_step(request.hidden, request.attention_mask, b, t, h)
        prompts = codec.decode(request.prompts, "prompts", finite=True).float() if k else None
        deltas = _decoded(lora)
        grad = codec.decode(request.grad_output, "grad_output", finite=True) if with_grad else None
        return TrainRequest(blocks, hidden, mask, prompts, deltas), grad

    def decode_lora(self, weights, blocks) -> tuple[LoraDelta, ...]:
        """A client's LoRA for `blocks` (a request's or a session's), headers checked first, then the data."""
        return _decoded(self._lora_headers(weights, blocks))

    def _lora_headers(self, weights, blocks) -> list[pb.LoraWeights]:
        if len(weights) > self.config.max_lora_layers:
            raise InvalidRequest(f"lora: {len(weights)} layers exceed the limit of {self.config.max_lora_layers}")
        seen = set()
        for w in weights:
            if not blocks.start <= w.block < blocks.end:
                raise InvalidRequest(f"lora: block {w.block} is outside the request's {blocks}")
            layer = training.linear_layers(self.stage, w.block).get(w.module)
            if layer is None:
                raise InvalidRequest(f"lora: block {w.block} has no linear layer {w.module[:80]!r}")
            if (w.block, w.module) in seen:
                raise InvalidRequest(f"lora: block {w.block} {w.module!r} given twice")
            seen.add((w.block, w.module))
            if not (math.isfinite(w.scale) and abs(w.scale) <= 1e4):
                raise InvalidRequest(f"lora: scale {w.scale} is not a finite number of at most 1e4")
            _, a_shape = codec.header(w.a, "lora.a", max_elements=self.config.max_lora_rank * layer.in_features)
            r = a_shape[0]
            if not 1 <= r <= self.config.max_lora_rank:
                raise InvalidRequest(f"lora: rank {r} is not in [1, {self.config.max_lora_rank}]")
            _float_header(w.a, "lora.a", (r, layer.in_features))
            _float_header(w.b, "lora.b", (layer.out_features, r))
        return list(weights)

    # ---- compute -----------------------------------------------------------------------------------------
    async def _job(self, fn, batch_tokens: int) -> tuple[object, JobTiming]:
        """One block's work on the compute thread, as prefill: decodes of other sessions go first."""
        return await self.scheduler.submit_batchable(
            Batchable(_call_each, object(), fn, member=object()), StepKind.PREFILL, batch_tokens)

    async def run_forward(self, req: TrainRequest) -> tuple[list[torch.Tensor], float, float]:
        """Every block's input and the span's output (inputs[-1]); queued and compute seconds."""
        inputs, queued, compute = [req.hidden], 0.0, 0.0
        batch_tokens = int(req.hidden.shape[0] * req.hidden.shape[1])
        for i in range(req.blocks.length):
            out, timing = await self._job(
                lambda i=i, x=inputs[-1]: training.forward_block(self.stage, req, i, x), batch_tokens)
            inputs.append(out)
            queued, compute = queued + timing.queued_s, compute + timing.compute_s
        return inputs, queued, compute

    async def run_backward(self, req: TrainRequest, grad: torch.Tensor):
        """Keep every block's graph from one pass under autograd when the request's memory bound allows it (the
        span's forward then runs once here), else recompute each block when its turn comes (block inputs kept by a
        pass without autograd: twice)."""
        b, t = req.hidden.shape[:2]
        batch_tokens, n = int(b * t), req.blocks.length
        keep = training.backward_bytes(self.stage, n, b, t, kept_graphs=n) <= self.config.max_train_request_bytes
        queued = compute = 0.0
        graphs, hidden = [], req.hidden
        if keep:
            for i in range(n):
                graph, timing = await self._job(lambda i=i, x=hidden: training.block_graph(self.stage, req, i, x),
                                                batch_tokens)
                graphs.append(graph)
                hidden = graph.out.detach()
                queued, compute = queued + timing.queued_s, compute + timing.compute_s
        else:
            inputs, queued, compute = await self.run_forward(req)
        prompt_grads: list[torch.Tensor | None] = [None] * n
        lora_grads: dict[tuple[int, str, str], torch.Tensor] = {}
        for i in reversed(range(n)):
            work = (lambda i=i, g=grad: training.differentiate(graphs.pop(), req, g)) if keep else \
                (lambda i=i, g=grad: training.backward_block(self.stage, req, i, inputs[i], g))
            grads, timing = await self._job(work, batch_tokens)
            grad, prompt_grads[i] = grads.hidden, grads.prompt
            lora_grads.update({(req.blocks.start + i, *key): g for key, g in grads.lora.items()})
            queued, compute = queued + timing.queued_s, compute + timing.compute_s
        prompts = torch.stack(prompt_grads) if req.prompts is not None else None
        return grad, prompts, lora_grads, queued, compute

    # ---- RPCs (through the service's UnaryGate: refusals and the peer's bytes handled there) ----------------
    async def forward(self, request: pb.ForwardRequest, admission: Admission) -> pb.ForwardReply:
        def encode(inputs: list[torch.Tensor]) -> pb.ForwardReply:
            return pb.ForwardReply(hidden=compress.encode_like(inputs[-1], request.hidden.dtype))

        return await self._serve(request, admission, False, lambda req, _: self.run_forward(req), encode)

    async def backward(self, request: pb.BackwardRequest, admission: Admission) -> pb.BackwardReply:
        def encode(grad_in: torch.Tensor, grad_prompts: torch.Tensor | None, lora_grads: dict) -> pb.BackwardReply:
            reply = pb.BackwardReply(grad_hidden=compress.encode_like(grad_in, request.grad_output.dtype))
            if grad_prompts is not None:
                reply.grad_prompts.CopyFrom(codec.encode(grad_prompts.float()))
            for w in request.lora:
                reply.grad_lora.append(pb.LoraWeights(
                    block=w.block, module=w.module, a=codec.encode(lora_grads[(w.block, w.module, "a")].float()),
                    b=codec.encode(lora_grads[(w.block, w.module, "b")].float())))
            return reply

        return await self._serve(request, admission, True, self.run_backward, encode)

    async def _serve(self, request, admission: Admission, with_grad: bool, run, encode):
        """One training RPC: its declared bytes charged to the peer, its memory estimate to the training budget
        (TrainBudget), then decoded (only once admitted), `run(req, grad)` -> (*results, queued_s, compute_s),
        `encode(*results)` -> the reply, its Timing added; the budget released."""
        started = time.perf_counter()
        admission.charge(_message_bytes(request))
        need = self.estimate(request)
        if not await self.budget.acquire(need):
            raise CapacityExceeded(f"training requests here already hold their {self.budget.total >> 20} MiB "
                                   f"budget (this one needs ~{need >> 20} MiB): retry later")
        try:
            req, grad = self.parse(request, with_grad)
            parsed = time.perf_counter()
            *results, queued, compute = await run(req, grad)
            encode_start = time.perf_counter()
            reply = encode(*results)
            reply.timing.CopyFrom(pb.Timing(queued_s=queued, compute_s=compute, parse_s=parsed - started,
                                            encode_s=time.perf_counter() - encode_start, batched_steps=1))
            return reply
        finally:
            await self.budget.release(need)
            if self.budget.used == 0:  # the last training request here ended: its freed heap back to the OS
                self.trim()
