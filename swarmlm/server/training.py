"""Training through the swarm, the server's compute: a span's forward and backward recomputed from its input. No
state is kept between requests, the weights stay frozen and no optimizer state lives here (docs/FINETUNING.md).

A span runs block by block, each block one call (`block_call`), so the scheduler can put other sessions' decode
steps between them. Backward keeps only each block's input ([B, T, H] per block) from a first pass without
autograd, then, from the last block back, runs each block again with autograd and differentiates it at once:
peak memory = every block's input + one block's activations (`backward_bytes`, bounded by
ServerConfig.max_train_request_bytes).

What a client may send with a request and get gradients for:
- deep prompts [blocks, B, K, H]: prompts[i] is added to the first K positions of block (start + i)'s input;
- its own LoRA: on a named linear layer of a block, out += scale * (x @ a^T) @ b^T, by a forward hook that lives
  for the one block call (calls run one at a time on the compute thread: no other request sees it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import Cache

from swarmlm.server import lora
from swarmlm.server.lora import LoraDelta

from swarmlm.server.stage import Stage
from swarmlm.types import BlockRange

ACTIVATION_WIDTHS = 6  # one block's saved activations, in hidden-size widths per token (q, k, v, attn out, norms)


@dataclass(frozen=True)
class TrainRequest:
    """One span's forward (and backward) inputs, validated by the service."""

    blocks: BlockRange
    hidden: torch.Tensor  # [B, T, H]
    mask: torch.Tensor  # [B, T] int64, 1 = token
    prompts: torch.Tensor | None = None  # [blocks, B, K, H]
    lora: tuple[LoraDelta, ...] = ()


class NoPastCache(Cache):
    """The cache a stateless block call sees: nothing before this request, nothing kept after it."""

    def __init__(self) -> None:
        super().__init__(layers=[])

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1


def linear_layers(stage: Stage, block: int) -> dict[str, nn.Module]:
    """Global block `block`'s linear layers by name (what a client's LoRA may target), int8 ones included."""
    return lora.linear_layers(stage.modules[block - stage.blocks.start])


def backward_bytes(stage: Stage, blocks: int, rows: int, n_tokens: int, kept_graphs: int = 1) -> int:
    """Estimated peak memory of one Backward: every block's input kept + the activations and scores of
    `kept_graphs` blocks (1: each block recomputed when its turn comes; `blocks`: every block's graph kept from one
    pass under autograd)."""
    config = stage.config
    width = int(stage.hidden_size)
    ffn = int(getattr(config, "intermediate_size", None) or getattr(config, "ffn_hidden_size", None) or 4 * width)
    heads = int(config.num_attention_heads)
    graph = ACTIVATION_WIDTHS * width + 3 * ffn + 3 * heads * n_tokens  # 3: scores, probs, grads
    return rows * n_tokens * (blocks * width + kept_graphs * graph) * stage.dtype.itemsize


def with_prompt(hidden: torch.Tensor, prompts: torch.Tensor | None, i: int) -> torch.Tensor:
    """Block i's input with its deep prompt added to the first K positions (a new tensor; autograd-safe)."""
    if prompts is None:
        return hidden
    k = prompts.shape[2]
    head = hidden[:, :k] + prompts[i].to(hidden.dtype)
    return torch.cat([head, hidden[:, k:]], dim=1)


def block_call(stage: Stage, block: int, hidden: torch.Tensor, mask: torch.Tensor,
               deltas: tuple[LoraDelta, ...] = ()) -> torch.Tensor:
    """Global block `block` on whole sequences [B, T, H] (no past), with the client's LoRA on its layers."""
    local = block - stage.blocks.start
    with lora.lora_hooks(stage.modules, stage.blocks.start, [d for d in deltas if d.block == block]):
        return stage.adapter.forward_span(stage.config, stage.modules[local:local + 1], hidden.to(stage.dtype),
                                          NoPastCache(), mask)


def forward_block(stage: Stage, req: TrainRequest, i: int, hidden: torch.Tensor) -> torch.Tensor:
    """Block start + i's output, no autograd; its input is `hidden` before the prompt."""
    with torch.no_grad():
        return block_call(stage, req.blocks.start + i, with_prompt(hidden, req.prompts, i), req.mask, req.lora)


@dataclass
class BlockGrads:
    hidden: torch.Tensor  # d loss / d block input (before its prompt)
    prompt: torch.Tensor | None  # d loss / d prompts[i]: [B, K, H]
    lora: dict[tuple[str, str], torch.Tensor]  # (module, "a" | "b") -> gradient, for the block's LoRA


@dataclass
class BlockGraph:
    """One block run under autograd: its input and LoRA leaves and its output, ready to differentiate."""

    x: torch.Tensor  # the block's input (before its prompt), a leaf
    deltas: tuple[LoraDelta, ...]  # the block's LoRA, a and b leaves
    out: torch.Tensor


def block_graph(stage: Stage, req: TrainRequest, i: int, hidden: torch.Tensor) -> BlockGraph:
    """Block start + i under autograd from its input `hidden` (before the prompt)."""
    block = req.blocks.start + i
    with torch.enable_grad():
        x = hidden.detach().to(stage.dtype).requires_grad_(True)
        deltas = tuple(LoraDelta(d.block, d.module, d.a.detach().requires_grad_(True),
                                 d.b.detach().requires_grad_(True), d.scale) for d in req.lora if d.block == block)
        return BlockGraph(x, deltas, block_call(stage, block, with_prompt(x, req.prompts, i), req.mask, deltas))


def differentiate(graph: BlockGraph, req: TrainRequest, grad_output: torch.Tensor) -> BlockGrads:
    """The block's gradients given its output's; frees its graph."""
    leaves = [graph.x] + [t for d in graph.deltas for t in (d.a, d.b)]
    grads = torch.autograd.grad(graph.out, leaves, grad_output.to(graph.out.dtype), allow_unused=True)
    grad_x = grads[0]
    lora_grads = {}
    for j, d in enumerate(graph.deltas):
        for k, name in enumerate(("a", "b")):
            g = grads[1 + 2 * j + k]
            lora_grads[(d.module, name)] = torch.zeros_like(d.a if name == "a" else d.b) if g is None else g
    prompt = None if req.prompts is None else grad_x[:, :req.prompts.shape[2]]  # the prompt is added: same grad
    return BlockGrads(grad_x, prompt, lora_grads)


def backward_block(stage: Stage, req: TrainRequest, i: int, hidden: torch.Tensor,
                   grad_output: torch.Tensor) -> BlockGrads:
    """Block start + i recomputed with autograd from its input `hidden` (before the prompt) and differentiated."""
    return differentiate(block_graph(stage, req, i, hidden), req, grad_output)
