"""Policies: one module (or one folder) each, registered by name (:mod:`.registry`); specs such as
``verkv:eps=0.05:sketch=perfect`` are parsed and validated in one place (:mod:`.spec`).
Importing this package loads no tensor code; :func:`make` does."""

from kvsim.policies.registry import ALIASES, REGISTRY, load_all, register, resolve
from kvsim.policies.spec import PolicySpec, make, parse

__all__ = ["ALIASES", "REGISTRY", "PolicySpec", "load_all", "make", "parse", "register",
           "resolve"]
