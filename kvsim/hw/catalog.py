"""Spec catalogs: GPUs (one record each in :mod:`kvsim.hw.gpus`, from public datasheets and
measurements) and model shapes (the published ``config.json`` fields in ``kvsim/hw/models/``,
read like a user's own config).

Every entry carries its public source; reports quote it as the provenance of the figure used.
A profiled trace (``kvsim profile``) replaces these numbers with measured ones.
"""

from __future__ import annotations

from kvsim.errors import KvsimError
from kvsim.hw import hfconfig
from kvsim.hw.gpus import GPUS, GPUSpec
from kvsim.hw.model_spec import ModelSpec

__all__ = ["GB", "GPUS", "MODELS", "GiB", "GPUSpec", "ModelSpec", "gpu", "model"]

GiB = 1024**3
GB = 1e9

MODELS: dict[str, ModelSpec] = hfconfig.builtin()  # from the configs in kvsim/hw/models/


def _lookup(table: dict, name: str, what: str):
    key = name.strip().lower()
    if key not in table:
        raise KvsimError(f"unknown {what} {name!r}; known: {', '.join(table)}")
    return table[key]


def gpu(name: str) -> GPUSpec:
    return _lookup(GPUS, name, "GPU")


def model(name: str) -> ModelSpec:
    """A catalog shape by name, or the shape of a Hugging Face ``config.json`` at a path."""
    if name.strip().lower() not in MODELS and hfconfig.looks_like_path(name):
        return hfconfig.load(name)
    try:
        return _lookup(MODELS, name, "model")
    except KvsimError as e:
        raise KvsimError(f"{e}; or give the path of a Hugging Face config.json") from None
