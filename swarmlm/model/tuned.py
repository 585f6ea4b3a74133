"""A tuned model on disk: what a client trained through the swarm (client/tuning.py), saved with its settings as a
folder in PEFT's format -- adapter_config.json + adapter_model.safetensors -- so one call loads it
(`from_pretrained(..., adapter=DIR)`, `swarmlm chat --adapter DIR`) and a server serves it (`server --adapters`).

- LoRA: PEFT's "LORA" (keys `base_model.model.<stack>.<block i>.<module>.lora_A.weight`): servers pre-load it and
  apply it inside cached sessions (server/adapters.py); PEFT's PeftModel loads it on the base checkpoint too.
- soft prompt: PEFT's "PROMPT_TUNING" (key `prompt_embeddings` [K, H]): the client prepends it.
- deep soft prompt: "SWARMLM_DEEP_PROMPT" (PEFT has no such type): `prompt_embeddings` and `deep_prompts`
  [blocks, K, H].
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

TuningMode = Literal["ptune", "deep_ptune", "lora"]
TUNING_MODES: tuple[str, ...] = ("ptune", "deep_ptune", "lora")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_TYPE = {"lora": "LORA", "ptune": "PROMPT_TUNING", "deep_ptune": "SWARMLM_DEEP_PROMPT"}
MODE_OF = {peft: mode for mode, peft in PEFT_TYPE.items()}


@dataclass(frozen=True)
class TunedSettings:
    """How a tuned model was built: what `from_pretrained`'s tuning options were."""

    mode: TuningMode
    pre_seq_len: int = 0  # soft prompt tokens (ptune, deep_ptune)
    lora_r: int = 0  # LoRA rank
    lora_alpha: float = 0.0  # LoRA scale numerator: out += alpha / r * x A^T B^T
    lora_target_modules: tuple[str, ...] = ()  # layer names or suffixes, as PEFT's target_modules
    base_model: str = ""  # the served name of the model it was tuned on (never a local path)

    def __post_init__(self) -> None:
        if self.mode not in TUNING_MODES:
            raise ValueError(f"tuning mode must be one of {', '.join(TUNING_MODES)}, got {self.mode!r}")
        if self.mode == "lora" and (self.lora_r < 1 or not self.lora_target_modules):
            raise ValueError(f"a LoRA needs r >= 1 and target modules, got r={self.lora_r}, "
                             f"targets={list(self.lora_target_modules)}")
        if self.mode != "lora" and self.pre_seq_len < 1:
            raise ValueError(f"a soft prompt needs >= 1 token, got {self.pre_seq_len}")

    @property
    def tuning_kwargs(self) -> dict:
        """from_pretrained's tuning options that rebuild this model."""
        if self.mode == "lora":
            return dict(tuning_mode="lora", lora_r=self.lora_r, lora_alpha=self.lora_alpha,
                        lora_target_modules=self.lora_target_modules)
        return dict(tuning_mode=self.mode, pre_seq_len=self.pre_seq_len)

    def peft_config(self, hidden_size: int, num_blocks: int) -> dict:
        common = {"peft_type": PEFT_TYPE[self.mode], "task_type": "CAUSAL_LM", "base_model_name_or_path": self.base_model}
        if self.mode == "lora":
            return {**common, "r": self.lora_r, "lora_alpha": self.lora_alpha, "lora_dropout": 0.0, "bias": "none",
                    "target_modules": list(self.lora_target_modules), "use_rslora": False, "use_dora": False,
                    "fan_in_fan_out": False}
        return {**common, "num_virtual_tokens": self.pre_seq_len, "token_dim": hidden_size,
                "num_layers": num_blocks, "num_transformer_submodules": 1}


def read_settings(directory: str | Path) -> TunedSettings:
    """A saved tuned model's settings; a folder that is not one is a one-line error naming what is missing."""
    directory = Path(directory)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory}: no {name} (a tuned model is a folder saved by save_adapter, or "
                                    "a PEFT adapter)")
    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{directory / CONFIG_FILE}: not JSON ({exc})") from None
    kind = config.get("peft_type", "LORA") if isinstance(config, dict) else None
    if kind not in MODE_OF:
        raise ValueError(f"{directory}: peft_type {kind!r} is not one swarmlm runs ({', '.join(MODE_OF)})")
    try:
        if kind == "LORA":
            targets = config.get("target_modules") or ()
            return TunedSettings("lora", lora_r=int(config["r"]), lora_alpha=float(config["lora_alpha"]),
                                 lora_target_modules=(targets,) if isinstance(targets, str) else tuple(targets),
                                 base_model=str(config.get("base_model_name_or_path") or ""))
        return TunedSettings(MODE_OF[kind], pre_seq_len=int(config["num_virtual_tokens"]),
                             base_model=str(config.get("base_model_name_or_path") or ""))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{directory / CONFIG_FILE}: missing or bad field {exc}") from None


def write(directory: str | Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().float().contiguous() for k, v in tensors.items()}, str(directory / WEIGHTS_FILE),
              metadata={"format": "pt"})  # (PEFT writes the same metadata)
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def tensor_shapes(directory: str | Path) -> dict[str, tuple[int, ...]]:
    """The saved tensors' shapes, read from the file's header (no tensor data)."""
    with safe_open(str(Path(directory) / WEIGHTS_FILE), "pt") as f:
        return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}


def lora_key(family, block: int, module: str, which: str) -> str:
    """PEFT's key of a LoRA matrix (which: "A" or "B") of `module` in block `block` of a `family` model."""
    return f"base_model.model.{family.stack_prefixes[0]}{family.block_prefix().format(block)}{module}.lora_{which}.weight"


def block_linears(family, config, block: int) -> dict[str, nn.Module]:
    """A block's linear layers by name, built on the meta device (names and shapes only: no weights)."""
    with torch.device("meta"):
        module = family.build_block(config, block, cache_idx=0)
    return {name: m for name, m in module.named_modules() if isinstance(m, nn.Linear)}
