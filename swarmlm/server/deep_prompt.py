"""A session's deep prompt (per-block prompt tuning, Petals' "deep_ptune") on this server's span.

The client sends it once, with the open (`OpenSession.prompts`, [span blocks, K, H]); the session keeps it, and
whichever step writes a position p < K -- the first step, a chunk of it, a failover replay, a pushed step -- gets
prompts[i][:, p] added to block i's input there (training adds the same to the first K positions of a Forward,
server/training.py). Later positions run as any session's. Keyed by session position, the prompt needs nothing more
on the wire for chunking, push or replay.
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from swarmlm.errors import InvalidRequest
from swarmlm.types import BlockRange
from swarmlm.wire import codec
from swarmlm.wire import swarm_pb2 as pb

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def decode_prompts(msg: pb.Tensor, blocks: BlockRange, max_length: int, hidden_size: int) -> torch.Tensor | None:
    """An open's deep prompt [blocks, K, H] (1 <= K <= max_length), float, finite; None when absent. The shape is
    checked from the header before any data is read."""
    if not codec.is_set(msg):
        return None
    dtype, shape = codec.header(msg, "prompts", max_elements=blocks.length * max_length * hidden_size)
    if dtype not in FLOAT_DTYPES:
        raise InvalidRequest(f"prompts: dtype {dtype} is not a float type")
    if len(shape) != 3 or shape[0] != blocks.length or not 1 <= shape[1] <= max_length or shape[2] != hidden_size:
        raise InvalidRequest(f"prompts: expected [{blocks.length}, K <= {max_length}, {hidden_size}] for blocks "
                             f"{blocks}, got {list(shape)}")
    return codec.decode(msg, "prompts", max_elements=math.prod(shape), finite=True).float()


def prompt_bytes(prompts: torch.Tensor | None, dtype: torch.dtype) -> int:
    """What a session's prompt holds here (counted in its reservation)."""
    return 0 if prompts is None else prompts.numel() * dtype.itemsize


def touches(prompts: torch.Tensor | None, position: int) -> bool:
    """Does a step starting at session position `position` write prompt positions?"""
    return prompts is not None and position < prompts.shape[1]


@contextlib.contextmanager
def prompt_hooks(blocks: nn.ModuleList, prompts: torch.Tensor, position: int):
    """For one forward over `blocks` (the session's span) of new tokens starting at `position`: block i's input
    gets prompts[i] added at the prompt positions the step covers. Forwards run one at a time on the compute
    thread, so no other request sees the hooks (as server/lora.py's)."""
    k = prompts.shape[1]

    def hook_for(prompt: torch.Tensor):
        def add_prompt(module, args):
            hidden = args[0]  # [B, T, H], every family calls a block with its hidden states first
            n = min(k - position, hidden.shape[1])
            head = hidden[:, :n] + prompt[position:position + n].to(hidden.dtype)
            return (torch.cat([head, hidden[:, n:]], dim=1), *args[1:])
        return add_prompt

    handles = []
    try:
        for block, prompt in zip(blocks, prompts):
            handles.append(block.register_forward_pre_hook(hook_for(prompt)))
        yield
    finally:
        for handle in handles:
            handle.remove()
