"""Model shapes from a Hugging Face ``config.json`` (a file, or a directory holding one): what a
user brings for a model the catalog does not have. Read locally; nothing is downloaded.

Read: layers, query and KV heads, head dimension (``head_dim``, else hidden / heads), hidden and
intermediate sizes, vocabulary, tied embeddings, ``max_position_embeddings`` (times a YaRN or
linear ``rope_scaling`` factor), ``rope_theta`` and the dtype. A multimodal config's
``text_config`` is the language model planned. Mixture of experts: ``num_experts`` /
``num_local_experts`` / ``n_routed_experts``, ``num_experts_per_tok`` (or ``moe_topk``),
``moe_intermediate_size`` (Mixtral: ``intermediate_size``), shared experts
(``shared_expert_intermediate_size``, or ``n_shared_experts`` x the expert size) and the layers
that have experts (``first_k_dense_replace``, ``mlp_only_layers``, ``decoder_sparse_step``).
Attention kvsim does not model (multi-head latent attention: ``kv_lora_rank``) is refused in one
line rather than planned wrong.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from kvsim.errors import KvsimError

if TYPE_CHECKING:  # catalog imports this module: a runtime import would be circular
    from kvsim.hw.catalog import ModelSpec

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float": 4, "half": 2}
MODELS_DIR = Path(__file__).resolve().parent / "models"


def looks_like_path(name: str) -> bool:
    return name.endswith(".json") or "/" in name or Path(name).exists()


def builtin() -> dict:
    """The catalog's model shapes: the configs in ``kvsim/hw/models/`` (published fields, the
    model named and sourced by their ``_kvsim`` entry)."""
    return {m.name: m for m in (load(p) for p in sorted(MODELS_DIR.glob("*.json")))}


def _int(cfg: dict, key: str, where: str, default=None, positive=True) -> int:
    v = cfg.get(key, default)
    if v is None:
        raise KvsimError(f"{where}: config has no {key}")
    if isinstance(v, list):  # per-layer lists (some MoE configs): the first layer's
        if not v:
            raise KvsimError(f"{where}: {key} is an empty list")
        v = v[0]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or \
            (positive and v < 1) or v < 0:
        raise KvsimError(f"{where}: {key} must be a {'positive ' if positive else ''}whole "
                         f"number, got {v!r}")
    return int(v)


def load(path: str | Path) -> ModelSpec:
    """The :class:`ModelSpec` of a ``config.json`` (or of a directory's)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise KvsimError(f"{path}: no such config.json (kvsim reads local files only; download "
                         f"the model's config.json first)")
    try:
        cfg = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise KvsimError(f"{p}: not a readable JSON config ({e})") from None
    if not isinstance(cfg, dict):
        raise KvsimError(f"{p}: a config.json holds a JSON object")
    return parse(cfg, str(p))


def _name(cfg: dict) -> str:
    """What a config calls its model: ``_name_or_path`` (``Qwen/Qwen3-4B``), else its
    architecture (``Qwen3ForCausalLM``), else its ``model_type``; never the folder it was copied
    into (``h-new``), which says nothing of the model."""
    arch = cfg.get("architectures")
    arch = arch[0] if isinstance(arch, list) and arch else arch
    for v in (cfg.get("_name_or_path"), arch, cfg.get("model_type")):
        if isinstance(v, str) and v.strip():
            return v.strip().rstrip("/")
    return "unnamed model"


def parse(cfg: dict, where: str) -> ModelSpec:
    """The shape a config's fields describe; an ``_kvsim`` entry (the catalog's own configs)
    names it and its source."""
    from kvsim.hw.catalog import ModelSpec
    own = cfg.get("_kvsim") if isinstance(cfg.get("_kvsim"), dict) else {}
    top = cfg
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**{k: v for k, v in cfg.items() if k != "text_config"}, **cfg["text_config"]}
    if cfg.get("kv_lora_rank"):
        raise KvsimError(f"{where}: multi-head latent attention (kv_lora_rank) is not modelled "
                         f"by kvsim; its KV cache is not K and V per head")
    layers = _int(cfg, "num_hidden_layers", where)
    heads = _int(cfg, "num_attention_heads", where)
    kv = _int(cfg, "num_key_value_heads", where, default=heads)
    hidden = _int(cfg, "hidden_size", where)
    if heads % kv:
        raise KvsimError(f"{where}: {heads} attention heads are not a multiple of {kv} KV heads")
    head_dim = _int(cfg, "head_dim", where, default=hidden // heads if hidden % heads == 0
                    else None)
    vocab = _int(cfg, "vocab_size", where)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    if dtype not in DTYPE_BYTES:
        raise KvsimError(f"{where}: dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    max_pos = _int(cfg, "max_position_embeddings", where, default=4096)
    scaling = cfg.get("rope_scaling") if isinstance(cfg.get("rope_scaling"), dict) else {}
    factor = scaling.get("factor")
    if scaling.get("rope_type", scaling.get("type")) in ("yarn", "linear", "dynamic") and \
            isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 1:
        base = scaling.get("original_max_position_embeddings") or max_pos
        max_pos = max(max_pos, int(base * factor))
    experts = 0
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if cfg.get(key):
            experts = _int(cfg, key, where)
            break
    moe = {}
    if experts:
        per_tok = _int(cfg, "num_experts_per_tok" if "num_experts_per_tok" in cfg
                       else "moe_topk", where)
        size = _int(cfg, "moe_intermediate_size" if cfg.get("moe_intermediate_size")
                    else "intermediate_size", where)
        shared = cfg.get("shared_expert_intermediate_size") or \
            (cfg.get("n_shared_experts") or cfg.get("num_shared_expert") or 0) * size
        if isinstance(shared, list):
            shared = shared[0] * size
        dense_layers = set(range(int(cfg.get("first_k_dense_replace") or 0)))
        dense_layers |= {int(x) for x in cfg.get("mlp_only_layers") or []}
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense_layers |= {i for i in range(layers) if (i + 1) % step}
        moe = dict(experts=experts, experts_per_token=per_tok, moe_intermediate=size,
                   shared_intermediate=int(shared),
                   moe_layers=layers - len(dense_layers & set(range(layers))))
    inter = _int(cfg, "intermediate_size", where, default=0, positive=False)
    name = own.get("name") or _name(top)
    note = own.get("note") or ("MoE" if experts else "")
    return ModelSpec(str(name), str(own.get("hf_id") or where), layers, heads, kv, head_dim,
                     hidden, inter, vocab,
                     bool(top.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
                     theta, max_pos, DTYPE_BYTES[dtype], note=note, **moe)
