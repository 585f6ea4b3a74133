"""transformers-style entry points: `AutoDistributedModelForCausalLM` and `AutoTokenizer` take every name
`from_pretrained` takes (a directory, a GGUF file, a catalog name, a hub id at a revision)."""
from __future__ import annotations

from pathlib import Path

from swarmlm.client.model import DistributedModelForCausalLM
from swarmlm.model.source import with_revision


class AutoTokenizer:
    """As transformers' AutoTokenizer, for every name `from_pretrained` takes: a directory, a GGUF file, a catalog
    name (`smollm2-135m-instruct`) or a hub id; the same loader as the model's (checkpoint.load_tokenizer)."""

    def __init__(self) -> None:
        raise EnvironmentError("use AutoTokenizer.from_pretrained(name_or_path)")

    @staticmethod
    def from_pretrained(name_or_path: str | Path, revision: str | None = None):
        from swarmlm.model.checkpoint import load_tokenizer

        return load_tokenizer(with_revision(name_or_path, revision))


class AutoDistributedModelForCausalLM:
    """As transformers' AutoModelForCausalLM: `from_pretrained` reads the family from config.json. One client class
    serves every family (the family adapters differ on the servers), so this returns a DistributedModelForCausalLM."""

    def __init__(self) -> None:
        raise EnvironmentError("use AutoDistributedModelForCausalLM.from_pretrained(name_or_path, initial_peers=...)")

    @staticmethod
    def from_pretrained(name_or_path: str | Path, *args, **kwargs) -> DistributedModelForCausalLM:
        return DistributedModelForCausalLM.from_pretrained(name_or_path, *args, **kwargs)
