"""What every policy gives the simulator, and the registry that finds policies by name.

A policy runs its real algorithm on a trace's attention tensors (when it needs them) and returns a
:class:`PolicyResult`: statistics measured on the trace, and a :class:`DecodeCost` that says, as
shares of one sequence's full KV cache, what it holds in HBM and host memory and what it reads and
moves per decode step. The simulator scales those shares to the planned model and context.

To add a policy: one file in ``kvsim/policies/`` with one subclass of :class:`Policy` decorated
with :func:`register`; options are fields of its ``Params`` dataclass (the CLI builds flags from
them: ``field(default=..., metadata={"help": ..., "choices": [...]})``).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsim.errors import KvsimError
from kvsim.kernels.attention import dense_attention
from kvsim.trace import Trace


@dataclass(frozen=True)
class DecodeCost:
    """Per sequence and decode step, as shares of that sequence's full KV cache (all layers)."""
    resident_frac: float  # KV state held in HBM (kept tokens, sample, sketch, metadata)
    hbm_read_frac: float  # read from HBM by attention per step
    host_read_frac: float  # moved over the host link per step (the "KV read" of the paper)
    host_frac: float  # held in host memory
    overlap: bool  # layer l+1's transfer may run during layer l's compute (double buffering)
    copies_per_layer: float = 0.0  # link copies per sequence and layer (each pays alpha)
    path: str = "h2d"  # "h2d": contiguous DMA; "gather": scattered rows
    staging_layers: int = 0  # layers of transferred KV buffered in HBM at once
    decide_bytes_per_token: float = 0.0  # per context token and KV head, if it decides each step

    def __post_init__(self):
        for f in ("resident_frac", "hbm_read_frac", "host_read_frac", "host_frac"):
            v = getattr(self, f)
            if not 0.0 <= v <= 1.0 + 1e-9:
                raise ValueError(f"DecodeCost.{f} = {v} is not a share in [0, 1]")


@dataclass
class PolicyResult:
    name: str
    params: dict
    cost: DecodeCost
    stats: dict  # measured on the trace (JSON-able), or derived from the definition
    provenance: str  # where the shares came from


@dataclass
class NoParams:
    def validate(self) -> None:
        pass


class Policy(ABC):
    name: ClassVar[str]
    Params: ClassVar[type] = NoParams
    needs_attention: ClassVar[bool] = False
    summary: ClassVar[str] = ""

    def __init__(self, params):
        self.params = params

    # ---- in the attention path: trace replay and model evaluation call these per layer ----
    rope: dict | None = None  # the model's RoPE settings ({"theta", "type"}), set by bind()

    def bind(self, rope: dict, head_dim: int) -> None:
        """Called once before ``compress`` with the model's RoPE settings and head size."""
        self.rope = dict(rope or {})

    def compress(self, k: torch.Tensor, v: torch.Tensor, scores: dict[str, torch.Tensor],
                 obs_q: torch.Tensor, obs_pos: torch.Tensor, generator: torch.Generator,
                 layer: int):
        """After the context prefill of layer ``layer``, decide what stays resident.

        ``k``, ``v``: (n_kv, n_ctx, d) post-RoPE keys and values of the context; ``scores``:
        per-token scorer outputs (n_kv, n_ctx) the trace or model provides (e.g. "kvzip");
        ``obs_q``, ``obs_pos``: (n_q, w, d) observation-window queries and their positions (for
        SnapKV-style scoring). Returns a per-layer state for :meth:`attend` (dense: None).
        """
        return None

    def attend(self, state, q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Attention of query rows ``q`` (n_q, m, d) at positions ``q_pos`` (m,).

        ``k``, ``v`` (n_kv, n, d) hold the full cache: the context (as given to
        :meth:`compress`; a policy may use only what it kept or fetched of it) followed by the
        tokens appended since (question and decoded tokens, always exact). Returns the output
        (n_q, m, d) and per-decision statistics (tensors of shape (n_q, m), e.g. tokens fetched).
        """
        out, _ = dense_attention(q, k, v, q_pos)
        return out, {}

    @abstractmethod
    def analyze(self, trace: Trace | None, seed: int = 0) -> PolicyResult:
        """Run the policy (on ``trace.attention`` if it needs it) and say what it costs."""

    def result(self, cost: DecodeCost, stats: dict, provenance: str) -> PolicyResult:
        return PolicyResult(self.name, dataclasses.asdict(self.params), cost, stats, provenance)


REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    if cls.name in REGISTRY:
        raise RuntimeError(f"policy {cls.name!r} registered twice")
    REGISTRY[cls.name] = cls
    return cls


def make(name: str, options: dict | None = None) -> Policy:
    """The policy ``name`` with ``options`` (only those it accepts; each is validated)."""
    from kvsim.policies import load_all
    load_all()
    if name not in REGISTRY:
        raise KvsimError(f"unknown policy {name!r}; known: {', '.join(sorted(REGISTRY))}")
    cls = REGISTRY[name]
    options = dict(options or {})
    fields = {f.name for f in dataclasses.fields(cls.Params)}
    foreign = sorted(set(options) - fields)
    if foreign:
        flags = ", ".join("--" + f.replace("_", "-") for f in foreign)
        accepted = ", ".join("--" + f.replace("_", "-") for f in sorted(fields)) or "no options"
        raise KvsimError(f"{flags} does not apply to policy {name} (it takes {accepted})")
    params = cls.Params(**options)
    params.validate()
    return cls(params)
