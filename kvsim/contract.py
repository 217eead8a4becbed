"""What a policy hands the simulator: torch-free, so that the simulator and the planner never load
the policies' tensor code.

A policy runs its algorithm on a trace (``kvsim.measure.harness``) and returns a
:class:`PolicyResult`: statistics measured on the trace and a :class:`DecodeCost` that says, as
shares of one sequence's full KV cache, what it holds in HBM and host memory and what it reads
and moves per decode step. The simulator scales those shares to the planned model and context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SHARES = ("resident_frac", "meta_frac", "hbm_read_frac", "host_read_frac", "host_frac")


@dataclass(frozen=True)
class DecodeCost:
    """Per sequence and decode step, as shares of that sequence's full KV cache (all layers)."""
    resident_frac: float  # state held in HBM: kept tokens plus ``meta_frac``
    hbm_read_frac: float  # read from HBM by attention per step
    host_read_frac: float  # moved over the host link per step (the "KV read" of the paper)
    host_frac: float  # held in host memory
    overlap: bool  # layer l+1's transfer may run during layer l's compute (double buffering)
    copies_per_layer: float = 0.0  # link copies per sequence and layer (each pays alpha)
    path: str = "h2d"  # "h2d": contiguous DMA; "gather": scattered rows
    staging_layers: int = 0  # layers of transferred KV buffered in HBM at once
    decide_bytes_per_token: float = 0.0  # per context token and KV head, if it decides each step
    meta_frac: float = 0.0  # of resident_frac: sketch, inclusion probabilities, codec metadata
    decide_kernel: str = ""  # whose decide-cost model an engine applies ("verkv")

    def __post_init__(self):
        for f in SHARES:
            v = getattr(self, f)
            if not 0.0 <= v <= 1.0 + 1e-9:
                raise ValueError(f"DecodeCost.{f} = {v} is not a share in [0, 1]")
        if self.meta_frac > self.resident_frac + 1e-12:
            raise ValueError(f"DecodeCost.meta_frac {self.meta_frac} exceeds resident_frac "
                             f"{self.resident_frac}: metadata is part of the resident state")


@dataclass(frozen=True)
class PrefillWork:
    """A policy's own work after a context's prefill (scoring, sampling, sketching, coding), for
    one sequence of ``n`` context tokens on the planned model, all layers:
    ``flops = flops_per_token * n + flops_per_token_sq * n**2``, ``hbm_bytes = bytes_per_token * n``,
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
