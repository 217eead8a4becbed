"""A policy: one class that compresses a layer's context, attends through what it kept, and turns
measured statistics into a :class:`~kvsim.contract.DecodeCost`.

Policies are pure transformations: they never call the measuring code. The harness
(``kvsim.measure.harness`` on a trace, ``kvsim.measure.evaluate`` inside a real model) is the only
caller of :meth:`Policy.compress` and :meth:`Policy.attend`; it compares every output with dense
attention, aggregates the statistics (``kvsim.measure.stats``) and asks the policy for its cost.

To add a policy: one file in ``kvsim/policies/`` with one subclass of :class:`Policy` decorated
with :func:`kvsim.policies.register`; options are fields of its ``Params`` dataclass (the CLI builds
flags from them: ``field(default=..., metadata={"help": ..., "choices": [...]})``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvsim.attention.dense import dense_attention
from kvsim.contract import DecodeCost, PrefillWork

KV_ELEM_BYTES = 2  # bytes per K or V element of the cache a policy is costed against (16-bit)


@dataclass
class Compressed:
    """What :meth:`Policy.compress` keeps of one layer's context, per KV head (mean over heads)."""
    state: object  # the policy's own; handed back to :meth:`Policy.attend`
    held_tokens: float  # context tokens whose K/V stay in HBM
    held_bytes: float  # HBM bytes: those tokens' K/V plus ``meta_bytes``
    meta_bytes: float = 0.0  # of which sketch, inclusion probabilities, codec metadata
    info: dict = field(default_factory=dict)  # other per-layer facts, see Policy.summarize


@dataclass
class NoParams:
    def validate(self) -> None:
        pass


class Policy(ABC):
    name: ClassVar[str]
    Params: ClassVar[type] = NoParams
    needs_attention: ClassVar[bool] = False  # runs on a trace's attention section
    summary: ClassVar[str] = ""
    # which rows the harness hands ``compress`` as the observation window: "question" (the last
    # question rows: the query-aware setting) or "context" (the last context rows; none in a trace
    # without them, and the trace's "snapkv" scores stand in)
    observation: ClassVar[str] = "question"
    times_compress: ClassVar[bool] = False  # the harness times compress against dense prefill

    def __init__(self, params):
        self.params = params
        self.rope: dict = {}
        self.notes: set[str] = set()  # what the policy adapted to a trace (reported as warnings)
        self.sink_local: tuple[int, int] = (0, 0)  # the sizes the last budget resolved

    def budget(self, n_ctx: int, sketch_tokens: float = 0.0, need_sample: bool = True) -> float:
        """Tokens per KV head left for the sample at this context, after sink, local (as given,
        or the defaults shrunk to fit: noted) and the sketch; sets ``sink_local``."""
        from kvsim.policies.options import check_budget
        p = self.params
        b = check_budget(self.name, n_ctx, p.compression, p.sink, p.local, sketch_tokens,
                         need_sample)
        if b.note:
            self.notes.add(b.note)
        self.sink_local = (b.sink, b.local)
        return b.left

    def bind(self, rope: dict, head_dim: int) -> None:
        """Called once before ``compress`` with the model's RoPE settings and head size."""
        self.rope = dict(rope or {})

    def check(self, trace) -> None:
        """Before any work on ``trace``: a one-line error if this policy cannot run on it."""

    def compress(self, k: torch.Tensor, v: torch.Tensor, scores: dict[str, torch.Tensor],
                 obs_q: torch.Tensor, obs_pos: torch.Tensor, generator: torch.Generator,
                 layer: int, obs_k: torch.Tensor | None = None) -> Compressed:
        """After the context prefill of layer ``layer``, decide what stays resident.

        ``k``, ``v``: (n_kv, n_ctx, d) post-RoPE keys and values of the context; ``scores``:
        per-token scorer outputs (n_kv, n_ctx) the trace or model provides (e.g. "kvzip");
        ``obs_q``, ``obs_pos``: (n_q, w, d) observation-window queries and their positions;
        ``obs_k``: (n_kv, a, d) the keys after the context (positions n_ctx ..) where the window
        lies after it (question rows), which SnapKV's softmax includes; None otherwise.
        Default: everything stays (dense).
        """
        n_kv, n_ctx, d = k.shape
        return Compressed(None, float(n_ctx), n_ctx * 2.0 * d * KV_ELEM_BYTES)

    def attend(self, state, q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Attention of query rows ``q`` (n_q, m, d) at positions ``q_pos`` (m,).

        ``k``, ``v`` (n_kv, n, d) hold the full cache: the context (as given to
        :meth:`compress`; a policy may use only what it kept or fetched of it) followed by the
        tokens appended since (question and decoded tokens, always exact). Returns the output
        (n_q, m, d) and per-decision statistics (tensors of shape (n_q, m); their names are
        defined in :mod:`kvsim.measure.stats`).
        """
        out, _ = dense_attention(q, k, v, q_pos)
        return out, {}

    def summarize(self, infos: list[dict]) -> dict:
        """Run statistics from the ``Compressed.info`` of every compressed layer (default: none)."""
        return {}

    @abstractmethod
    def decode_cost(self, stats: dict) -> DecodeCost:
        """The cost the simulator charges, from the statistics the harness measured (keys of
        :mod:`kvsim.measure.stats`, plus ``resident_frac``, ``meta_frac`` and ``head_dim`` for
        policies that run on attention; an empty dict for those that need none)."""

    def prefill_work(self, model) -> PrefillWork:
        """The policy's own work after a context's prefill on ``model`` (a ModelSpec: layers,
        heads, head dim, dtype), counted from its algorithm: FLOPs and HBM bytes per context
        token (and per token squared). Default: none."""
        return PrefillWork()

    def decide_kernel(self, device, model, context: int, seed: int = 0):
        """For a policy that decides per step what to fetch (``decide_bytes_per_token > 0``):
        its decide step for one layer and sequence on a synthetic layer of ``model``'s head shape
        (an object with ``plan()``, as ``kvsim.policies.verkv.bench``), which ``kvsim profile``
        times and ``kvsim validate`` runs inside real decode steps. None otherwise."""
        return None

    def provenance(self, stats: dict) -> str:
        """What the report should add about where this policy's figures came from."""
        return ""

    def definition_stats(self) -> dict:
        """Statistics a policy that needs no trace knows by definition."""
        return {}
