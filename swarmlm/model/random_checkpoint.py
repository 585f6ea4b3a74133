"""`swarmlm model init`: a randomly initialised checkpoint with a real architecture and a working tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from swarmlm.model.families import FAMILIES
from swarmlm.model.presets import get_preset
from swarmlm.model.tokenizer import BOS_ID, EOS_ID, PAD_ID, save_tokenizer


def init_checkpoint(
    preset_name: str,
    out_dir: str | Path,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str = "1GB",
    num_layers: int | None = None,
) -> Path:
    """Write `config.json`, safetensors shards (+ index when sharded) and the tokenizer to out_dir."""
    preset = get_preset(preset_name)
    config = preset_config(preset_name, num_layers)
    _check_fits_in_memory(preset_name, config, dtype)  # (before anything is written)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    special_ids = dict(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                       pad_token_id=config.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = special_ids["pad_token_id"]
    model.save_pretrained(out, max_shard_size=max_shard_size)
    save_tokenizer(min(preset.tokenizer_vocab, config.vocab_size), out, pad=not preset.llama3_tokens)
    (out / "swarmlm.json").write_text(json.dumps({"preset": preset_name, "seed": seed, "dtype": str(dtype)}))
    return out


def checkpoint_bytes(config, dtype: torch.dtype = torch.float32) -> int:
    """The model's weights at this dtype (counted on the meta device: nothing allocated)."""
    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters()) * dtype.itemsize


def fits_in_memory(preset_name: str, dtype: torch.dtype = torch.float32) -> bool:
    """Whether init_checkpoint could build the preset whole in the memory available now."""
    import psutil

    return checkpoint_bytes(preset_config(preset_name), dtype) <= psutil.virtual_memory().available


def _check_fits_in_memory(preset_name: str, config, dtype: torch.dtype) -> None:
    """A model that init_checkpoint would build whole in memory, and that does not fit: one line, before trying."""
    import psutil

    need, available = checkpoint_bytes(config, dtype), psutil.virtual_memory().available
    if need > available:
        raise ValueError(f"{preset_name} at {str(dtype).removeprefix('torch.')} takes {need / 2**30:.1f} GiB, more "
                         f"than the {available / 2**30:.1f} GiB available: write it as one GGUF, tensor by tensor, "
                         "with --gguf q4_0 (or q8_0, f16, f32)")


def preset_config(preset_name: str, num_layers: int | None = None):
    """The transformers config of a preset (`num_layers`: same family and widths, another depth, e.g. 24 tiny blocks
    for placement tests)."""
    preset = get_preset(preset_name)
    shape = dict(preset.config)
    if num_layers is not None:
        shape["n_layer" if preset.family == "bloom" else "num_hidden_layers"] = num_layers
    if preset.llama3_tokens:  # no pad id, a list of eos ids
        special_ids = dict(bos_token_id=BOS_ID, eos_token_id=[EOS_ID, PAD_ID], pad_token_id=None)
    else:
        special_ids = dict(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    return FAMILIES[preset.family].config_class(**shape, **special_ids)


def init_gguf(preset_name: str, out: str | Path, gguf_type: str = "q4_0", seed: int = 0,
              num_layers: int | None = None) -> Path:
    """The preset's random weights written straight to one GGUF file, tensor by tensor (model/gguf_writer.py):
    memory near one row chunk, whatever the model's size."""
    from swarmlm.model.gguf_writer import write_gguf

    preset = get_preset(preset_name)
    return write_gguf(preset_config(preset_name, num_layers), out, gguf_type, seed,
                      tokenizer_vocab=preset.tokenizer_vocab, pad_token=not preset.llama3_tokens,
                      name=f"swarmlm-{preset_name}-seed{seed}")


def default_checkpoint(preset_name: str = "bloomz-560m", seed: int = 0, cache_dir: Path | None = None) -> Path:
    """The checkpoint `swarmlm demo` uses, created once and cached."""
    cache_dir = cache_dir or Path.home() / ".cache" / "swarmlm" / "checkpoints"
    path = cache_dir / f"{preset_name}-seed{seed}"
    if not (path / "swarmlm.json").is_file():  # written last: a half-written directory is redone
        init_checkpoint(preset_name, path, seed=seed)
    return path
