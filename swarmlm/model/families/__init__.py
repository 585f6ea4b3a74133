"""Model families: one small module each, registered by config.model_type (see docs/MODELS.md)."""
from swarmlm.model.families import bloom, falcon, gemma2, llama, mistral, mixtral, qwen2, qwen3  # noqa: F401  (register)
from swarmlm.model.families.base import FAMILIES, ClientModules, FamilyAdapter, family_for, register

__all__ = ["FAMILIES", "ClientModules", "FamilyAdapter", "family_for", "register"]
