"""transformers' conventions for what generate() returns, on the speculative path too: `return_dict_in_generate`
gives a GenerateDecoderOnlyOutput (`sequences`, and with `output_logits` / `output_scores` one [B, V] tensor per new
token: the model's logits, and the processed scores the token was chosen from). What speculation cannot give is
refused, naming the option."""
from __future__ import annotations

import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerateDecoderOnlyOutput

from swarmlm.client.decoding.sampling import Sampling
from swarmlm.errors import InvalidRequest

NEVER = ("output_attentions", "output_hidden_states")  # the servers return neither


def check_outputs(config: GenerationConfig, rows: int) -> None:
    """Refuse the output options speculation cannot honour (InvalidRequest naming the option)."""
    for name in NEVER:
        if getattr(config, name, False) and config.return_dict_in_generate:
            raise InvalidRequest(f"{name}=True is not available with speculative= (the servers return neither "
                                 "attentions nor hidden states): pass speculative='off'")
    for name in ("output_scores", "output_logits"):
        if getattr(config, name, False) and config.return_dict_in_generate and rows > 1:
            raise InvalidRequest(f"{name}=True with speculative= takes one sequence (batch 1, "
                                 f"num_return_sequences 1), got {rows} rows: pass speculative='off'")


class OutputCollector:
    """One row's logits as the passes yield them, turned into generate()'s output object at the end."""

    def __init__(self, config: GenerationConfig) -> None:
        self.config = config
        self.wanted = bool(config.return_dict_in_generate and (config.output_scores or config.output_logits))
        self.logits: list[torch.Tensor] = []  # [n, V] per pass, row 0's

    def on_logits(self, row: int, logits: torch.Tensor) -> None:
        if self.wanted and row == 0:
            self.logits.append(logits.float())

    def output(self, sequences: torch.Tensor, prompt_tokens: int, cache=None):
        """The bare sequences [B, T] (return_dict_in_generate off), or transformers' output object."""
        if not self.config.return_dict_in_generate:
            return sequences
        logits = torch.cat(self.logits).unbind(0) if self.logits else ()
        rows = tuple(row[None] for row in logits)  # one [1, V] per new token
        scores = None
        if self.config.output_scores:
            processors = Sampling.from_generation_config(self.config, max_new_tokens=1).processors()
            scores = tuple(processors(sequences[:, :prompt_tokens + i], row.clone()) if len(processors) else row
                           for i, row in enumerate(rows))
        return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores,
                                         logits=rows if self.config.output_logits else None, cache=cache)
