"""What a client trains through the swarm (docs/FINETUNING.md): soft prompts and its own LoRA. The base model's
weights stay frozen on the client and on the servers; these are the model's only trainable parameters.

- "ptune": K trainable embeddings prepended to every sequence (PEFT's prompt tuning, Petals' "ptune").
- "deep_ptune": those, plus a prompt per block added to the first K positions of that block's input (Petals'
  "deep_ptune"; zero at the start, so training begins at the plain model).
- "lora": A [r, in] and B [out, r] for chosen linear layers of every block (PEFT's init: A kaiming-uniform, B zero;
  out += alpha / r * x A^T B^T), sent with each request; the servers return their gradients.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from swarmlm.client.autograd import LoraSpec
from swarmlm.model import tuned
from swarmlm.model.tuned import TUNING_MODES, TunedSettings, TuningMode, block_linears  # noqa: F401  (re-exported)
from swarmlm.wire import codec
from swarmlm.wire import swarm_pb2 as pb


class PromptTuning(nn.Module):
    def __init__(self, pre_seq_len: int, hidden_size: int, num_blocks: int, deep: bool) -> None:
        super().__init__()
        if pre_seq_len < 1:
            raise ValueError(f"pre_seq_len must be >= 1 for prompt tuning, got {pre_seq_len}")
        self.pre_seq_len, self.num_blocks = pre_seq_len, num_blocks
        self.prompt_embeddings = nn.Parameter(torch.randn(pre_seq_len, hidden_size) * 0.02)  # [K, H]
        # [blocks, K, H], zero: a deep prompt starts as no change at all
        self.deep_prompts = nn.Parameter(torch.zeros(num_blocks, pre_seq_len, hidden_size)) if deep else None

    def prepend(self, hidden: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T, H], [B, T] -> [B, K + T, H], [B, K + T]: the prompt before every sequence."""
        b = hidden.shape[0]
        prompt = self.prompt_embeddings.to(hidden.dtype).unsqueeze(0).expand(b, -1, -1)
        ones = torch.ones(b, self.pre_seq_len, dtype=mask.dtype)
        return torch.cat([prompt, hidden], dim=1), torch.cat([ones, mask], dim=1)

    def block_prompts(self, batch: int) -> torch.Tensor | None:
        """[blocks, B, K, H] for the servers, or None without deep prompts."""
        if self.deep_prompts is None:
            return None
        return self.deep_prompts.unsqueeze(1).expand(-1, batch, -1, -1)


class ClientLora(nn.Module):
    """LoRA matrices for `target_modules` (names or name suffixes, as PEFT's) of every block."""

    def __init__(self, adapter, config, r: int = 8, alpha: float = 16.0,
                 target_modules: Sequence[str] = ("q_proj", "v_proj")) -> None:
        super().__init__()
        if r < 1:
            raise ValueError(f"lora_r must be >= 1, got {r}")
        self.r, self.alpha, self.target_modules = r, float(alpha), tuple(target_modules)
        self.specs: list[LoraSpec] = []
        self.a, self.b = nn.ParameterList(), nn.ParameterList()
        for block in range(int(config.num_hidden_layers)):
            for name, layer in block_linears(adapter, config, block).items():
                if not any(name == t or name.endswith("." + t) for t in target_modules):
                    continue
                a = nn.Parameter(torch.empty(r, layer.in_features))
                nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # PEFT's (and nn.Linear's) default
                self.a.append(a)
                self.b.append(nn.Parameter(torch.zeros(layer.out_features, r)))
                self.specs.append(LoraSpec(block, name, alpha / r))
        if not self.specs:
            raise ValueError(f"no linear layer of the blocks matches target_modules {list(target_modules)}")

    def triples(self) -> list[tuple[LoraSpec, torch.Tensor, torch.Tensor]]:
        return list(zip(self.specs, self.a, self.b))

    def wire(self) -> list[pb.LoraWeights]:
        """The matrices as they are now, for an inference session's opens (each server takes its blocks')."""
        return [pb.LoraWeights(block=s.block, module=s.module, scale=s.scale, a=codec.encode(a.detach().float()),
                               b=codec.encode(b.detach().float())) for s, a, b in self.triples()]


def save_trainable(module: nn.Module, path: str | Path) -> None:
    """The trainable tensors (prompts, LoRA) as safetensors; the base weights are not in it."""
    save_file({k: v.detach().contiguous() for k, v in module.named_parameters() if v.requires_grad}, str(path))


def load_trainable(module: nn.Module, path: str | Path) -> None:
    """Values saved by save_trainable, into a model built with the same tuning options (names and shapes must
    match)."""
    own = {k: v for k, v in module.named_parameters() if v.requires_grad}
    saved = load_file(str(path))
    if set(saved) != set(own):
        raise ValueError(f"{path}: tensors {sorted(saved)[:6]} do not match this model's {sorted(own)[:6]}")
    with torch.no_grad():
        for name, value in saved.items():
            if value.shape != own[name].shape:
                raise ValueError(f"{path}: {name} is {list(value.shape)}, expected {list(own[name].shape)}")
            own[name].copy_(value)


def settings_of(model, base_model: str) -> TunedSettings:
    """What a tuned DistributedModelForCausalLM was built with."""
    if model.lora is not None:
        return TunedSettings("lora", lora_r=model.lora.r, lora_alpha=model.lora.alpha,
                             lora_target_modules=model.lora.target_modules, base_model=base_model)
    if model.prompts is not None:
        deep = model.prompts.deep_prompts is not None
        return TunedSettings("deep_ptune" if deep else "ptune", pre_seq_len=model.prompts.pre_seq_len,
                             base_model=base_model)
    raise ValueError("this model has nothing tuned: build it with tuning_mode= to train, then save it")


def _file_keys(model) -> dict[str, nn.Parameter]:
    """The saved folder's tensor key -> the model's parameter (model/tuned.py's format)."""
    if model.lora is not None:
        keys = {}
        for spec, a, b in model.lora.triples():
            keys[tuned.lora_key(model.adapter, spec.block, spec.module, "A")] = a
            keys[tuned.lora_key(model.adapter, spec.block, spec.module, "B")] = b
        return keys
    keys = {"prompt_embeddings": model.prompts.prompt_embeddings}
    if model.prompts.deep_prompts is not None:
        keys["deep_prompts"] = model.prompts.deep_prompts
    return keys


def save_adapter(model, directory: str | Path, base_model: str) -> None:
    """The tuned tensors and their settings as a folder (model/tuned.py): PEFT's format for LoRA and soft prompts."""
    settings = settings_of(model, base_model)
    config = settings.peft_config(int(model.config.hidden_size), model.num_blocks)
    tuned.write(directory, config, {key: p for key, p in _file_keys(model).items()})


def load_adapter_weights(model, directory: str | Path) -> None:
    """A saved folder's tensors into a model built with its settings (TunedSettings.tuning_kwargs)."""
    own = _file_keys(model)
    saved = load_file(str(Path(directory) / tuned.WEIGHTS_FILE))
    if set(saved) != set(own):
        missing, extra = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
        raise ValueError(f"{directory}: its tensors do not match this model's (missing {missing[:3]}, "
                         f"unexpected {extra[:3]}): tuned on another model?")
    with torch.no_grad():
        for key, value in saved.items():
            if value.shape != own[key].shape:
                raise ValueError(f"{directory}: {key} is {list(value.shape)}, this model's is "
                                 f"{list(own[key].shape)}: tuned on another model?")
            own[key].copy_(value)


def find_tuned(ref: str | Path) -> tuple[TunedSettings | None, Path | None, str | None]:
    """adapter= / --adapter: (settings, folder, served name). A saved soft prompt: its settings and folder (the
    client prepends it); a LoRA's folder or a bare name: the name of the adapter servers pre-load (`server --adapters
    DIR` names it by its directory)."""
    path = Path(ref).expanduser()
    if path.is_dir():
        settings = tuned.read_settings(path)
        return settings, path, path.name if settings.mode == "lora" else None
    text = str(ref)
    if not text or "/" in text or text.startswith(("~", ".")):
        raise FileNotFoundError(f"adapter {text!r}: no such directory (give a folder saved by save_adapter, or the "
                                "name of an adapter servers pre-load)")
    return None, None, text


def adapter_tuning(adapter: str | Path | None) -> tuple[Path | None, str | None, dict]:
    """adapter= (find_tuned): (its folder, the name servers pre-load it by (a LoRA) or None, the tuning options of a
    soft prompt the client holds ({} otherwise))."""
    if adapter is None:
        return None, None, {}
    settings, folder, served = find_tuned(adapter)
    if served is not None or settings is None:
        return folder, served, {}
    return folder, None, dict(tuning_mode=settings.mode, pre_seq_len=settings.pre_seq_len)
