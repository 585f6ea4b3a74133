"""What a peer sends, checked before anything runs: a step's block range, shape and costs from its tensors' headers
alone (nothing decoded yet), its cache op, then its tensors (finite hidden states, a 0/1 mask). Every resource
limit is a ServerConfig setting (docs/FAILURES.md, "Bounded resources"); the wire's own bounds (push targets, prefix
keys, frame headers) are constants of the modules that check them."""
from __future__ import annotations

import math

import torch

from swarmlm.config import ServerConfig
from swarmlm.errors import InvalidRequest
from swarmlm.small_reads import no_padding_mask
from swarmlm.types import BlockRange, CacheOp
from swarmlm.wire import codec
from swarmlm.wire.compact import CompactStep
from swarmlm.wire import swarm_pb2 as pb

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MASK_DTYPES = (torch.int64, torch.int32, torch.uint8, torch.bool)


class StepChecks:
    """The checks that depend on this server: its range, hidden size and limits."""

    def __init__(self, config: ServerConfig, blocks: BlockRange, hidden_size: int) -> None:
        self.config, self.blocks, self.hidden_size = config, blocks, hidden_size

    def range(self, start: int, end: int) -> BlockRange:
        if not (self.blocks.start <= start < end <= self.blocks.end):
            raise InvalidRequest(f"blocks [{start}, {end}) are not inside this server's {self.blocks}")
        return BlockRange(start, end)

    def shape(self, msg: pb.Tensor, batch: int | None, past: int, max_length: int) -> tuple[int, int]:
        """Rows and new tokens of a request's hidden states, from the header alone; every size and cost limit."""
        cfg = self.config
        dtype, shape = codec.header(msg, "hidden", max_elements=cfg.max_message_bytes // 2)
        if dtype not in FLOAT_DTYPES:
            raise InvalidRequest(f"hidden: dtype {dtype} is not a float type")
        if len(shape) != 3:
            raise InvalidRequest(f"hidden: expected shape [batch, tokens, {self.hidden_size}], got {list(shape)}")
        return self.dims(*shape, batch, past, max_length)

    def dims(self, b: int, t: int, h: int, batch: int | None, past: int, max_length: int) -> tuple[int, int]:
        """`shape`'s checks of the dims [b, t, h] of a step's hidden states (a protobuf step's header, a compact
        STEP's: wire/compact.py): every size and cost limit."""
        cfg = self.config
        if h != self.hidden_size:
            raise InvalidRequest(f"hidden: hidden size {h} does not match the model's {self.hidden_size}")
        if t < 1 or b < 1:
            raise InvalidRequest(f"hidden: empty shape {[b, t, h]}")
        if batch is not None and b != batch:
            raise InvalidRequest(f"hidden: batch {b} does not match the session's batch {batch}")
        if b > cfg.max_batch:
            raise InvalidRequest(f"hidden: batch {b} exceeds the limit of {cfg.max_batch}")
        if past + t > max_length:
            raise InvalidRequest(f"step of {t} tokens would exceed the max_length {max_length} (it holds {past})")
        if b * t > cfg.max_request_tokens:
            raise InvalidRequest(f"hidden: {b} x {t} tokens exceed the limit of {cfg.max_request_tokens}")
        if b * t * (past + t) > cfg.max_attention_cost:
            raise InvalidRequest(
                f"hidden: attention cost {b} x {t} x {past + t} exceeds the limit of {cfg.max_attention_cost}")
        return b, t


def peer_host(context) -> str:
    """The remote host of a call ("ipv4:1.2.3.4:5678" -> "1.2.3.4"): quotas count per host, not per connection."""
    peer = context.peer() or "unknown"
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rsplit(":", 1)[0].strip("[]")
    return peer


def payload_bytes(step: pb.InferenceStep) -> int:
    """The bytes a step's tensors declare (from their headers: nothing is copied); 0 if a header is invalid. A
    compact STEP's: the bytes its values take."""
    if type(step) is CompactStep:
        return step.nbytes
    total = 0
    for msg in (step.hidden, step.attention_mask):
        name = msg.dtype
        if not name:  # not sent (or no dtype: an invalid header, nothing counted)
            continue
        try:
            _, shape = codec.header(msg)
        except InvalidRequest:
            continue
        total += math.prod(shape) * codec.WIRE_DTYPES.get(name, (None, 1))[1]  # packed: ~1
    return total


def check_cache_op(op: CacheOp | None, position: int, rows: int, reserved_rows: int) -> tuple[int, int | None]:
    """Tokens a session keeps after `op` and the rows its step must have (None: any up to the reserved batch)."""
    if op is None:
        return position, (rows if position else None)
    return op.check(position, rows, reserved_rows)


def decode_step(hidden_msg: pb.Tensor, mask_msg: pb.Tensor, b: int, t: int,
                hidden_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensors of a request whose header passed `StepChecks.shape`: hidden [b, t, hidden_size] (finite)
    and its mask [b, t] (0 or 1; all ones when not sent)."""
    masked = codec.is_set(mask_msg)
    if masked:  # the mask's header too, before anything is decoded
        mask_dtype, mask_shape = codec.header(mask_msg, "attention_mask", max_elements=b * t)
        if mask_dtype not in MASK_DTYPES or mask_shape != (b, t):
            raise InvalidRequest(
                f"attention_mask: expected an integer [{b}, {t}] tensor, got {mask_dtype} {list(mask_shape)}")
    # (its header is the one `StepChecks.shape` checked: [b, t, hidden_size])
    hidden = codec.decode_checked(hidden_msg, (b, t, hidden_size), "hidden", finite=True)
    if not masked or codec.all_ones(mask_msg):  # (no padding: the usual case, checked cheaply)
        return hidden, no_padding_mask(b, t)  # (kept per shape: a torch call per step saved)
    mask = codec.decode(mask_msg, "attention_mask", max_elements=b * t).to(torch.long)
    if ((mask != 0) & (mask != 1)).any():
        raise InvalidRequest("attention_mask: values must be 0 or 1")
    return hidden, mask

