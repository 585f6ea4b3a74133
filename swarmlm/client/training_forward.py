"""The model's differentiable forward (docs/FINETUNING.md): embeddings (+ soft prompt) on the client, the blocks
through the swarm as autograd nodes (client/autograd.py), final norm + LM head + transformers' causal-LM loss on
the client. A batch of more than ClientConfig.train_chunk_tokens rows x tokens goes in chunks of rows: each chunk
its own chain of requests, so a request's memory on a server stays bounded."""
from __future__ import annotations

import torch
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.modeling_outputs import CausalLMOutputWithPast

from swarmlm.client.autograd import run_route
from swarmlm.errors import InvalidRequest

IGNORE = -100  # transformers' ignore_index


def row_chunks(rows: int, n_tokens: int, chunk_tokens: int) -> list[slice]:
    """Rows in chunks of at most chunk_tokens rows x tokens (at least one row each)."""
    per = max(1, chunk_tokens // n_tokens)
    return [slice(start, min(start + per, rows)) for start in range(0, rows, per)]


def train_forward(model, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None,
                  mask: torch.Tensor | None, labels: torch.Tensor | None, keep: slice) -> CausalLMOutputWithPast:
    if inputs_embeds is None:
        with torch.no_grad():
            inputs_embeds = model.client_modules.embed(model._checked(input_ids))
    batch, n_tokens = inputs_embeds.shape[:2]
    mask = torch.ones(batch, n_tokens, dtype=torch.long) if mask is None else mask.to(torch.long)
    if labels is not None and tuple(labels.shape) != (batch, n_tokens):
        raise InvalidRequest(f"labels must be [{batch}, {n_tokens}], got {list(labels.shape)}")
    prefix = 0
    if model.prompts is not None:  # the soft prompt before every sequence (as a token's embedding: BLOOM then
        inputs_embeds, mask = model.prompts.prepend(inputs_embeds, mask)  # normalises it too); no label there
        prefix = model.prompts.pre_seq_len
    hidden = model.embed_inputs(inputs_embeds)  # [B, K + T, H]
    deep = model.prompts.block_prompts(batch) if model.prompts is not None else None  # [blocks, B, K, H]
    lora = model.lora.triples() if model.lora is not None else []
    outs = []
    for rows in row_chunks(batch, int(hidden.shape[1]), model.client_config.train_chunk_tokens):
        outs.append(run_route(model.trainer, hidden[rows], mask[rows], deep[:, rows] if deep is not None else None,
                              lora, model.num_blocks))
    logits = model.head_with_grad(torch.cat(outs) if len(outs) > 1 else outs[0])
    loss = None
    if labels is not None:
        full = torch.cat([torch.full((batch, prefix), IGNORE, dtype=labels.dtype), labels], dim=1)
        loss = ForCausalLMLoss(logits, full, int(model.config.vocab_size))
    return CausalLMOutputWithPast(loss=loss, logits=logits[:, prefix:][:, keep])
