"""A model's shape (:class:`ModelSpec`): layers, heads, widths, vocabulary, experts and element
sizes, and what follows from them (weights, KV bytes per token, FLOPs, a tensor-parallel shard).

Its own module so that both the catalog (:mod:`kvsim.hw.catalog`, which lists the built-in
shapes) and the config reader (:mod:`kvsim.hw.hfconfig`, which makes one from a Hugging Face
``config.json``) import it without importing each other.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from kvsim.errors import KvsimError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hf_id: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    rope_theta: float
    max_context: int
    dtype_bytes: int = 2  # bf16 weights and KV cache

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of every layer and KV head for one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_elem

    @property
    def kv_elem(self) -> float:
        """Bytes per KV-cache element (``--kv-dtype``; the compute dtype's by default)."""
        return self.kv_dtype_bytes or self.dtype_bytes

    @property
    def weight_elem(self) -> float:
        """Bytes per layer weight (``--weight-dtype``; embeddings and LM head stay in the
        compute dtype, as quantised checkpoints leave them)."""
        return self.weight_dtype_bytes or self.dtype_bytes

    @property
    def attn_params(self) -> int:
        return self.hidden * self.head_dim * (2 * self.q_heads + 2 * self.kv_heads)

    def _mlp_params(self, experts: float) -> float:
        """A layer's MLP parameters, averaged over the layers, with ``experts`` routed experts
        counted (all for the weights held, the active ones for FLOPs)."""
        dense = self.mlp_matrices * self.hidden * self.intermediate
        if not self.experts:
            return dense
        moe = 3 * self.hidden * (experts * self.moe_intermediate + self.shared_intermediate) \
            + self.hidden * self.experts  # the router
        k = self.layers if self.moe_layers is None else self.moe_layers
        return (k * moe + (self.layers - k) * dense) / self.layers

    @property
    def layer_params(self) -> float:
        """Parameters of one layer (averaged over layers), every expert included."""
        return self.attn_params + self._mlp_params(self.experts)

    @property
    def active_layer_params(self) -> float:
        """Parameters one token passes through in a layer (its routed experts only)."""
        return self.attn_params + self._mlp_params(self.experts_per_token)

    def layer_weight_bytes(self, tokens=None):
        """Bytes of one layer's weights a forward pass over ``tokens`` tokens reads: every
        weight of a dense layer; of an MoE layer the experts the tokens route to, in
        expectation over uniform routing, ``E (1 - (1 - k/E)^tokens)`` (all without
        ``tokens``); with ``shared`` routing the ``k`` experts of one token."""
        if not self.experts or tokens is None:
            return self.layer_params * self.weight_elem
        t = np.asarray(tokens, float)
        hit = self.experts * (1.0 - (1.0 - self.experts_per_token / self.experts) ** t) \
            if self.routing == "uniform" else np.full_like(t, float(self.experts_per_token))
        return np.where(t > 0, self.attn_params + self._mlp_params(hit), 0.0) * self.weight_elem

    @property
    def params(self) -> float:
        return self.layers * self.layer_params + self.embed_params

    @property
    def active_params(self) -> float:
        return self.layers * self.active_layer_params + self.embed_params

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def weight_bytes(self) -> float:
        return self.layers * self.layer_params * self.weight_elem + \
            self.embed_params * self.dtype_bytes

    def prefill_flops(self, size, prefix=0):
        """FLOPs of the layers for ``size`` prompt tokens that follow ``prefix`` tokens already in
        the cache (a whole prompt: ``prefix`` 0; a chunk of chunked prefill otherwise), counting a
        multiply-add as 2 FLOPs:

        * GEMMs (QKV, O and the gated MLP): ``2 * active_layer_params`` per token and layer;
        * causal attention: each new token attends to the prefix and to itself and the new
          tokens before it, ``size * prefix + size * (size + 1) / 2`` query-key pairs per query
          head; QK^T and PV each cost ``2 * head_dim`` FLOPs per pair:
          ``4 * q_heads * head_dim * pairs`` per layer.

        Embedding lookups are not FLOPs; the LM head runs on the last token of a prompt only and
        is charged apart (``CostModel.head_time``). Numbers or numpy arrays alike."""
        return self.layers * 2.0 * self.active_layer_params * size + \
            self.attention_flops(size, prefix)

    def attention_flops(self, size, prefix=0):
        """The causal-attention part of :meth:`prefill_flops`, all layers."""
        pairs = size * prefix + size * (size + 1) / 2
        return self.layers * 4.0 * self.q_heads * self.head_dim * pairs

    @functools.cached_property  # (read once a simulated step)
    def flops_per_pair(self) -> float:
        """Attention FLOPs of one query-key pair, all layers and query heads: the factor of
        :meth:`attention_flops` (the same product, so ``flops_per_pair * pairs`` is its value
        to the bit)."""
        return self.layers * 4.0 * self.q_heads * self.head_dim

    note: str = ""
    # the dense MLP's matrices: 3 for a gated MLP (gate, up, down: Llama, Qwen, Mistral), 2 for
    # a plain one (up, down: GPT-J, GPT-NeoX, OPT, Falcon)
    mlp_matrices: int = 3
    # mixture of experts (0 experts: a dense model)
    experts: int = 0  # routed experts per MoE layer
    experts_per_token: int = 0
    moe_intermediate: int = 0  # per routed expert
    shared_intermediate: int = 0  # the always-active shared experts, in all
    moe_layers: int | None = None  # layers with experts (None: all of them)
    # how a step's tokens pick their experts: "uniform" (independently, uniformly: the
    # expectation over real traffic) or "shared" (every token like the first: a benchmark
    # that repeats one prompt across its batch and decodes greedily)
    routing: str = "uniform"
    # narrow (1-byte) weights dequantised for bf16 GEMMs (W8A16) instead of W8A8 fp8 GEMMs:
    # an engine without an fp8 kernel for the model (TensorRT-LLM before 0.10 for Mixtral)
    weight_only: bool = False
    # element bytes where they differ from dtype_bytes (the compute dtype)
    kv_dtype_bytes: float | None = None
    weight_dtype_bytes: float | None = None

    @property
    def source(self) -> str:
        return f"config.json of {self.hf_id}" + (f" ({self.note})" if self.note else "")

    def shard(self, tp: int) -> ModelSpec:
        """What one GPU of a tensor-parallel group of ``tp`` holds and computes, as vLLM shards:
        query heads, MLP (every expert's) width and vocabulary split ``tp`` ways; KV heads too,
        or replicated where there are fewer than ``tp`` of them (one per GPU)."""
        if tp == 1:
            return self
        for what, n in (("query heads", self.q_heads), ("intermediate size", self.intermediate),
                        ("expert width", self.moe_intermediate or tp)):
            if n % tp:
                raise KvsimError(f"--tp {tp}: {self.name}'s {what} ({n}) do not split {tp} ways")
        kv = max(1, self.kv_heads // tp) if self.kv_heads % tp == 0 or self.kv_heads < tp \
            else None
        if kv is None:
            raise KvsimError(f"--tp {tp}: {self.name}'s {self.kv_heads} KV heads do not split "
                             f"{tp} ways")
        return dataclasses.replace(
            self, q_heads=self.q_heads // tp, kv_heads=kv,
            intermediate=self.intermediate // tp, vocab=-(-self.vocab // tp),
            moe_intermediate=self.moe_intermediate // tp,
            shared_intermediate=self.shared_intermediate // tp)

    def describe(self) -> str:
        moe = (f" ({self.active_params / 1e9:.2f}B active, {self.experts} experts, "
               f"{self.experts_per_token} per token)" if self.experts else "")
        return (f"{self.name}: {self.params / 1e9:.2f}B params{moe}, {self.layers} layers, "
                f"{self.q_heads}q/{self.kv_heads}kv heads x {self.head_dim}, "
                f"{self.kv_bytes_per_token / 1024:.0f} KiB KV per token")
