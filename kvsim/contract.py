"""What a policy hands the simulator: torch-free, so that the simulator and the planner never load
the policies' tensor code.

A policy runs its algorithm on a trace (``kvsim.measure.harness``) and returns a
:class:`PolicyResult`: statistics measured on the trace and a :class:`DecodeCost` that says what
it holds in HBM and host memory and what it reads and moves per decode step, stated for the model
it serves (:class:`HeadShape`: what its byte counts depend on). Each of those four
terms says how it scales with the context: a share of it (``*_frac``, e.g. 1/compression of the
cache), a fixed number of tokens (``*_tokens``, e.g. a window of 1,020 tokens), or both; the
simulator charges ``min(n, frac * n + tokens)`` tokens' worth of KV for a sequence of ``n``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

SHARES = ("resident_frac", "meta_frac", "hbm_read_frac", "host_read_frac", "host_frac")
TERMS = ("resident", "hbm_read", "host_read", "host")  # each a share plus a fixed token count


@dataclass(frozen=True)
class HeadShape:
    """What a policy's byte counts depend on: the head size and the bytes of one KV-cache
    element. A :class:`~kvsim.hw.catalog.ModelSpec` has both (``head_dim``, ``kv_elem``); a
    trace's attention gives its own (16-bit)."""
    head_dim: int
    kv_elem: float = 2.0

    @property
    def kv_token_bytes(self) -> float:
        """K and V of one token for one KV head and layer."""
        return 2 * self.head_dim * self.kv_elem


def kv_token_bytes(model) -> float:
    """K and V of one token for one KV head and layer of ``model`` (a ModelSpec or a
    :class:`HeadShape`)."""
    return 2 * model.head_dim * model.kv_elem


@dataclass(frozen=True)
class DecodeCost:
    """Per sequence and decode step: shares of that sequence's full KV cache (all layers) plus
    fixed token counts (per KV head and layer, like a context length): :meth:`tokens`."""
    resident_frac: float  # state held in HBM: kept tokens plus ``meta_frac``
    hbm_read_frac: float  # read from HBM by attention per step
    host_read_frac: float  # moved over the host link per step (the "KV read" of the paper)
    host_frac: float  # held in host memory
    overlap: bool  # layer l+1's transfer may run during layer l's compute (double buffering)
    copies_per_layer: float = 0.0  # link copies per sequence and layer (each pays alpha)
    path: str = "h2d"  # "h2d": contiguous DMA; "gather": scattered rows
    staging_layers: int = 0  # layers of transferred KV buffered in HBM at once
    # bytes the decide step reads per context token and KV head (its sketch or bounds), on the
    # model the cost is stated for; 0: the policy does not decide per step
    decide_bytes_per_token: float = 0.0
    meta_frac: float = 0.0  # of resident_frac: sketch, inclusion probabilities, codec metadata
    decide_kernel: str = ""  # the policy whose decide-cost model an engine applies
    resident_tokens: float = 0.0  # tokens held in HBM whatever the context (a window, sinks)
    hbm_read_tokens: float = 0.0
    host_read_tokens: float = 0.0  # tokens moved over the host link per step (a page budget)
    host_tokens: float = 0.0

    def __post_init__(self):
        for f in SHARES:
            v = getattr(self, f)
            if not 0.0 <= v <= 1.0 + 1e-9:
                raise ValueError(f"DecodeCost.{f} = {v} is not a share in [0, 1]")
        for t in TERMS:
            v = getattr(self, f"{t}_tokens")
            if not (v >= 0.0 and v < float("inf")):
                raise ValueError(f"DecodeCost.{t}_tokens = {v} is not a token count >= 0")
        if self.meta_frac > self.resident_frac + 1e-12:
            raise ValueError(f"DecodeCost.meta_frac {self.meta_frac} exceeds resident_frac "
                             f"{self.resident_frac}: metadata is part of the resident state")

    def tokens(self, term: str, n):
        """Tokens' worth of KV that ``term`` (one of ``TERMS``) charges a sequence of ``n``
        tokens: the share of ``n`` plus the fixed count, never more than ``n``."""
        import numpy as np
        n = np.asarray(n, float)
        return np.minimum(n, getattr(self, f"{term}_frac") * n + getattr(self, f"{term}_tokens"))

    @property
    def fixed(self) -> bool:
        """Whether any term holds a fixed token count (else every term is a plain share)."""
        return any(getattr(self, f"{t}_tokens") for t in TERMS)

    def scaling(self) -> dict[str, str]:
        """How each term scales, in words, for reports: ``{"resident": "6.25% of the context +
        8 tokens", ...}``."""
        out = {}
        for t in TERMS:
            f, k = getattr(self, f"{t}_frac"), getattr(self, f"{t}_tokens")
            parts = ([f"{100 * f:.3g}% of the context"] if f else []) + \
                ([f"{k:g} tokens"] if k else [])
            out[t] = " + ".join(parts) or "none"
        return out


@dataclass(frozen=True)
class PrefillWork:
    """A policy's own work after a context's prefill (scoring, sampling, sketching, coding), for
    one sequence of ``n`` context tokens on the planned model, all layers:
    ``flops = flops_per_token * n + flops_per_token_sq * n**2``,
    ``hbm_bytes = bytes_per_token * n``,
    charged at the GPU's achievable rates (a roofline)."""
    flops_per_token: float = 0.0
    flops_per_token_sq: float = 0.0
    bytes_per_token: float = 0.0
    source: str = "none: the policy does no work at prefill"

    def flops(self, n):
        return self.flops_per_token * n + self.flops_per_token_sq * n * n

    def bytes(self, n):
        return self.bytes_per_token * n


@dataclass
class PolicyResult:
    name: str
    params: dict
    cost: DecodeCost
    stats: dict  # measured on the trace (JSON-able, the same for the same seed), or by definition
    provenance: str  # where the shares came from
    timings: dict = field(default_factory=dict)  # wall-clock measurements on this machine


DEFINITION = "by definition (exact attention; no trace statistics needed)"


def by_definition(policy, model=HeadShape(64)) -> PolicyResult:
    """The result of a policy whose statistics hold by definition (``needs_attention`` false:
    the dense baselines): no trace and no tensor code; its cost stated for ``model``."""
    stats = policy.definition_stats()
    return PolicyResult(policy.name, dataclasses.asdict(policy.params),
                        policy.decode_cost(stats, model), stats, DEFINITION, {})
