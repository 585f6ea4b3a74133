"""Kept for imports written before the families package: everything lives in swarmlm.model.families."""
from swarmlm.model.families import FAMILIES, ClientModules, FamilyAdapter, family_for, register  # noqa: F401
