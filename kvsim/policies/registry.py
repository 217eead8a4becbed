"""Policies by name. Each policy module registers its class on import; :func:`load_all` imports
every module of this package once. Torch-free until a policy module is imported."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from kvsim.errors import KvsimError

REGISTRY: dict[str, type] = {}
ALIASES = {"dense": "dense-resident"}  # the name kvsim eval has always accepted
_loaded = False


def register(cls):
    if cls.name in REGISTRY:
        raise RuntimeError(f"policy {cls.name!r} registered twice")
    REGISTRY[cls.name] = cls
    return cls


def load_all() -> dict[str, type]:
    """Import every module and subpackage of ``kvsim.policies``, so each registers its policy."""
    global _loaded
    if not _loaded:  # (the package's folder is this file's: importing it here would be a cycle)
        package = __name__.rsplit(".", 1)[0]
        for mod in pkgutil.iter_modules([str(Path(__file__).parent)]):
            if not mod.name.startswith("_"):
                importlib.import_module(f"{package}.{mod.name}")
        _loaded = True
    return REGISTRY


def deciding() -> list[str]:
    """The policies that decide per step what to fetch: fetching policies with a decide kernel
    of their own (dense offload fetches everything and decides nothing)."""
    from kvsim.policies.base import FetchPolicy
    return sorted(name for name, cls in load_all().items() if issubclass(cls, FetchPolicy)
                  and cls.decide_kernel is not FetchPolicy.decide_kernel)


def resolve(name: str) -> type:
    """The policy class registered as ``name`` (or an alias of it); one-line error otherwise."""
    registry = load_all()
    cls = registry.get(ALIASES.get(name, name))
    if cls is None:
        known = sorted(registry) + [f"{a} (= {b})" for a, b in ALIASES.items()]
        raise KvsimError(f"unknown policy {name!r}; known: {', '.join(known)}")
    return cls
