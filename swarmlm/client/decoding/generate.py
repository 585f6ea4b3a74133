"""generate(speculative=...): a GenerationConfig's generation through the Decoder, with transformers' conventions
(left-padded batches, num_return_sequences copies, pad after eos, streamers, return_dict_in_generate). What the
decoder does not cover (`decodes` False) runs transformers' own generate() over a RemoteCache."""
from __future__ import annotations

import torch
from transformers import GenerationConfig

from swarmlm.client.decoding.decoder import Decoder
from swarmlm.client.decoding.drafts import SpeculativeMode
from swarmlm.client.decoding.outputs import OutputCollector, check_outputs
from swarmlm.client.decoding.rows import is_left_padded
from swarmlm.client.decoding.sampling import Sampling, unsupported

PLAIN_ONLY = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "assistant_model")


def decodes(config: GenerationConfig, ids: torch.Tensor, kwargs: dict) -> bool:
    """Whether generate()'s call is the decoder's: prompts unpadded or padded on the left (a 0..0 1..1 mask per row;
    pad tokens with no mask, which transformers reads as padding unless pad is an eos token, are not), one streamed
    row, no caller-made processors or criteria, and options a Sampling covers."""
    mask = kwargs.get("attention_mask")
    pad, eos = config.pad_token_id, config.eos_token_id
    eos = [] if eos is None else eos if isinstance(eos, (list, tuple)) else [eos]
    padded_badly = not (mask.shape == ids.shape and is_left_padded(mask)) if mask is not None else \
        pad is not None and pad not in eos and bool((ids == pad).any())
    rows = int(ids.shape[0]) * (config.num_return_sequences or 1)
    streamed_batch = kwargs.get("streamer") is not None and rows > 1  # transformers' streamers take one row
    return (config.use_cache and not padded_badly and not streamed_batch
            and not any(kwargs.get(k) is not None for k in PLAIN_ONLY) and unsupported(config) is None)


def decoder_generate(model, ids: torch.Tensor, mask: torch.Tensor | None, config: GenerationConfig, session,
                     generator: torch.Generator | None, stats, mode: SpeculativeMode, draft_model, streamer):
    """The prompts' rows through the Decoder (num_return_sequences rows per prompt), in `session` or one it opens.
    Rows that end early are padded with pad_token_id (eos when unset), as transformers does. The sequences [R, T],
    or with return_dict_in_generate transformers' output object; model.last_stats is the run's GenerationStats."""
    copies = config.num_return_sequences or 1
    check_outputs(config, int(ids.shape[0]) * copies)
    width = int(ids.shape[1])
    max_new = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - width
    eos = config.eos_token_id  # the checkpoint's unless the caller set it (None: generate max_new tokens)
    eos = () if eos is None else tuple(eos if isinstance(eos, (list, tuple)) else [eos])
    decoder = Decoder(model, Sampling.from_generation_config(config, max_new), mode, draft_model, generator,
                      session=session, stats=stats)
    new: list[list[int]] = []
    outputs = OutputCollector(config)
    try:
        if streamer is not None:
            streamer.put(ids[0])
        on_tokens = streamer and (lambda row, tokens: streamer.put(torch.tensor(tokens)))
        new = decoder.generate_rows(ids, mask, max_new, eos, copies, on_tokens, outputs.on_logits)
    finally:
        if streamer is not None:
            streamer.end()
        out = padded_output(ids.repeat_interleave(copies, dim=0), new,
                            config.pad_token_id if config.pad_token_id is not None else (eos or (0,))[0])
        model.last_stats = decoder.close(out)
    return outputs.output(out, width, decoder.cache)


def padded_output(prompts: torch.Tensor, new: list[list[int]], pad: int) -> torch.Tensor:
    """generate()'s sequences: each row's prompt [R, T] and new tokens, rows that ended early padded with `pad`."""
    width = max((len(tokens) for tokens in new), default=0)
    rows = [prompt + tokens + [pad] * (width - len(tokens))
            for prompt, tokens in zip(prompts.tolist(), new or [[]] * len(prompts))]
    return torch.tensor(rows, dtype=torch.long)
