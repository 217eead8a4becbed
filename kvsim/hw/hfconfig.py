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

import math
from pathlib import Path

from kvsim.checks import real, whole
from kvsim.errors import KvsimError
from kvsim.hw.model_spec import ModelSpec

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float": 4, "half": 2}
MAX_SIZE = 2**40  # any layer count, width or vocabulary beyond this is a broken config
MODELS_DIR = Path(__file__).resolve().parent / "models"


def looks_like_path(name: str) -> bool:
    return name.endswith(".json") or "/" in name or Path(name).exists()


def builtin() -> dict:
    """The catalog's model shapes: the configs in ``kvsim/hw/models/`` (published fields, the
    model named and sourced by their ``_kvsim`` entry)."""
    return {m.name: m for m in (load(p) for p in sorted(MODELS_DIR.glob("*.json")))}


def _int(cfg: dict, key: str, where: str, default=None, positive=True) -> int:
    v = cfg.get(key)
    v = default if v is None else v
    if v is None:
        raise KvsimError(f"{where}: config has no {key}")
    if isinstance(v, list):  # per-layer lists (some MoE configs): the first layer's
        if not v:
            raise KvsimError(f"{where}: {key} is an empty list")
        v = v[0]
    return whole(v, f"{where}: {key}", least=1 if positive else 0, most=MAX_SIZE)


def load(path: str | Path) -> ModelSpec:
    """The :class:`ModelSpec` of a ``config.json`` (or of a directory's)."""
    from kvsim.io import read_json
    p = Path(path)
    folder = p.is_dir()
    if folder:
        p = p / "config.json"
    if not p.exists() and not p.is_symlink():
        raise KvsimError(f"{path}: {'is a directory without a' if folder else 'no such'} "
                         f"config.json (kvsim reads local files only; download the model's "
                         f"config.json first)")
    return parse(read_json(p, "Hugging Face config.json"), str(p))


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


# GPT-2-style field names (GPT-J, GPT-2, BLOOM, OPT's ffn_dim) -> the Llama-style ones
OLD_NAMES = {"n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
             "n_embd": "hidden_size", "n_inner": "intermediate_size",
             "n_positions": "max_position_embeddings", "ffn_dim": "intermediate_size"}
# model types whose MLP is not gated (up and down projections only): their modeling code in
# Hugging Face transformers (GPTJMLP fc_in/fc_out, GPTNeoXMLP, OPT fc1/fc2, FalconMLP, GPT2MLP,
# BloomMLP, PhiMLP, GPTBigCodeMLP, Starcoder2MLP)
PLAIN_MLP = {"gptj", "gpt_neox", "opt", "falcon", "gpt2", "bloom", "phi", "gpt_bigcode",
             "starcoder2"}


def parse(cfg: dict, where: str) -> ModelSpec:
    """The shape a config's fields describe; an ``_kvsim`` entry (the catalog's own configs)
    names it and its source."""
    own = cfg.get("_kvsim") if isinstance(cfg.get("_kvsim"), dict) else {}
    top = cfg
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**{k: v for k, v in cfg.items() if k != "text_config"}, **cfg["text_config"]}
    cfg = {**{new: cfg[old] for old, new in OLD_NAMES.items()
              if old in cfg and new not in cfg}, **cfg}
    plain = cfg.get("model_type") in PLAIN_MLP
    if plain and cfg.get("intermediate_size") is None:  # GPT-J's n_inner null: 4 x hidden
        cfg["intermediate_size"] = 4 * _int(cfg, "hidden_size", where)
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
    theta = real(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0,
                 f"{where}: rope_theta", above=0)
    max_pos = _int(cfg, "max_position_embeddings", where, default=4096)
    scaling = cfg.get("rope_scaling") if isinstance(cfg.get("rope_scaling"), dict) else {}
    factor = scaling.get("factor")
    if scaling.get("rope_type", scaling.get("type")) in ("yarn", "linear", "dynamic") and \
            isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 1:
        base = _int(scaling, "original_max_position_embeddings", where, default=max_pos)
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
        size = _int(cfg, "moe_intermediate_size" if "moe_intermediate_size" in cfg
                    and cfg["moe_intermediate_size"] is not None else "intermediate_size", where)
        if per_tok > experts:
            raise KvsimError(f"{where}: {per_tok} experts per token but only {experts} experts")
        n_shared = next((k for k in ("n_shared_experts", "num_shared_expert") if cfg.get(k)), "")
        shared = _int(cfg, "shared_expert_intermediate_size", where, 0, False) or \
            (_int(cfg, n_shared, where) * size if n_shared else 0)
        dense_layers = set(range(_int(cfg, "first_k_dense_replace", where, 0, False)))
        only = cfg.get("mlp_only_layers") or []
        if not isinstance(only, list):
            raise KvsimError(f"{where}: mlp_only_layers must be a list of layers, got {only!r}")
        dense_layers |= {whole(x, f"{where}: mlp_only_layers") for x in only}
        step = _int(cfg, "decoder_sparse_step", where, 1)
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
                     theta, max_pos, DTYPE_BYTES[dtype], note=note,
                     mlp_matrices=2 if plain else 3, **moe)
