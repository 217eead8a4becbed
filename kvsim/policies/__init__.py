"""Policies: one module each, registered by name (see :mod:`kvsim.policies.base`)."""

import importlib
import pkgutil

from kvsim.policies.base import REGISTRY, DecodeCost, Policy, PolicyResult, make, register

__all__ = ["REGISTRY", "DecodeCost", "Policy", "PolicyResult", "make", "register", "load_all"]

_loaded = False


def load_all() -> dict:
    """Import every module of this package once, so each registers its policy."""
    global _loaded
    if not _loaded:
        for mod in pkgutil.iter_modules(__path__):
            if not mod.name.startswith("_") and mod.name != "base":
                importlib.import_module(f"{__name__}.{mod.name}")
        _loaded = True
    return REGISTRY
