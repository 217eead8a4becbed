"""Spec catalogs: GPUs (one record each in :mod:`kvsim.hw.gpus`, from public datasheets and
measurements) and model shapes (the published ``config.json`` fields in ``kvsim/hw/models/``,
read like a user's own config).

Every entry carries its public source; reports quote it as the provenance of the figure used.
A profiled trace (``kvsim profile``) replaces these numbers with measured ones.
"""

from __future__ import annotations

from pathlib import Path

from kvsim.errors import KvsimError
from kvsim.hw import hfconfig
from kvsim.hw.gpus import GPUS, GPUSpec
from kvsim.hw.model_spec import ModelSpec

__all__ = ["GB", "GPUS", "MODELS", "GiB", "GPUSpec", "ModelSpec", "gpu", "model"]

GiB = 1024**3
GB = 1e9

MODELS: dict[str, ModelSpec] = hfconfig.builtin()  # from the configs in kvsim/hw/models/

# Hugging Face ids (lower case) of the catalog's shapes, with their instruct and quantised
# checkpoints (the same shapes): `--model meta-llama/Llama-3.1-70B-Instruct` is llama-3.1-70b
MODEL_IDS = {
    "meta-llama/llama-2-7b-hf": "llama-2-7b", "meta-llama/llama-2-7b-chat-hf": "llama-2-7b",
    "meta-llama/llama-2-13b-hf": "llama-2-13b", "meta-llama/llama-2-13b-chat-hf": "llama-2-13b",
    "meta-llama/llama-2-70b-hf": "llama-2-70b", "meta-llama/llama-2-70b-chat-hf": "llama-2-70b",
    "meta-llama/meta-llama-3-8b": "llama-3-8b", "meta-llama/meta-llama-3-70b": "llama-3.1-70b",
    "gradientai/llama-3-8b-instruct-gradient-1048k": "llama-3-8b-1048k",
    "meta-llama/llama-3.1-8b": "llama-3.1-8b", "meta-llama/llama-3.1-8b-instruct": "llama-3.1-8b",
    "meta-llama/meta-llama-3.1-8b-instruct": "llama-3.1-8b",
    "neuralmagic/meta-llama-3.1-8b-fp8": "llama-3.1-8b",
    "neuralmagic/meta-llama-3.1-8b-instruct-fp8": "llama-3.1-8b",
    "neuralmagic/meta-llama-3-8b-instruct-fp8": "llama-3-8b",
    "meta-llama/llama-3.1-70b-instruct": "llama-3.1-70b",
    "meta-llama/llama-3.3-70b-instruct": "llama-3.1-70b",
    "neuralmagic/meta-llama-3.1-70b-instruct-fp8": "llama-3.1-70b",
    "meta-llama/llama-3.1-405b-instruct": "llama-3.1-405b",
    "meta-llama/meta-llama-3.1-405b-instruct-fp8": "llama-3.1-405b",
    "mistralai/mistral-7b-v0.1": "mistral-7b", "mistralai/mistral-7b-instruct-v0.3": "mistral-7b",
    "mistralai/mixtral-8x7b-v0.1": "mixtral-8x7b",
    "mistralai/mixtral-8x7b-instruct-v0.1": "mixtral-8x7b",
    "mistralai/mixtral-8x22b-v0.1": "mixtral-8x22b",
    "mistralai/mixtral-8x22b-instruct-v0.1": "mixtral-8x22b",
    "01-ai/yi-9b-200k": "yi-9b-200k", "01-ai/yi-34b": "yi-34b",
    "qwen/qwen1.5-72b": "qwen1.5-72b", "qwen/qwen2-72b": "qwen2-72b",
    "qwen/qwen2-72b-instruct": "qwen2-72b",
    "qwen/qwen2.5-72b-instruct": "qwen2-72b",  # the same shapes as Qwen2-72B (80 x 8192, GQA 64/8)
    "qwen/qwen2.5-7b-instruct": "qwen2.5-7b",
    "qwen/qwen3-4b": "qwen3-4b", "qwen/qwen3-4b-fp8": "qwen3-4b",
    "qwen/qwen3-8b": "qwen3-8b", "qwen/qwen3-8b-fp8": "qwen3-8b",
}
MODEL_IDS.update({m.hf_id.lower(): k for k, m in MODELS.items() if m.hf_id})


def _lookup(table: dict, name: str, what: str):
    key = name.strip().lower()
    if key not in table:
        raise KvsimError(f"unknown {what} {name!r}; known: {', '.join(table)}")
    return table[key]


def gpu(name: str) -> GPUSpec:
    return _lookup(GPUS, name, "GPU")


def model(name: str) -> ModelSpec:
    """A catalog shape by name, or the shape of a Hugging Face ``config.json`` at a path."""
    key = name.strip().lower()
    if key in MODEL_IDS and not Path(name).exists():
        return MODELS[MODEL_IDS[key]]
    if key not in MODELS and hfconfig.looks_like_path(name):
        return hfconfig.load(name)
    try:
        return _lookup(MODELS, name, "model")
    except KvsimError as e:
        raise KvsimError(f"{e}; or give the path of a Hugging Face config.json") from None
