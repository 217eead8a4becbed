"""The two dense baselines: the whole cache in HBM, or the whole cache in host memory."""

from __future__ import annotations

from kvsim.policies.base import DecodeCost, Policy, register
from kvsim.trace import Trace

DEFINITION = "by definition (exact attention; no trace statistics needed)"


@register
class DenseResident(Policy):
    name = "dense-resident"
    summary = "the full KV cache in HBM; attention reads all of it each step"

    def analyze(self, trace: Trace | None, seed: int = 0):
        cost = DecodeCost(resident_frac=1.0, hbm_read_frac=1.0, host_read_frac=0.0,
                          host_frac=0.0, overlap=False)
        return self.result(cost, {"kv_read_frac": 0.0, "output_rel_err_mean": 0.0}, DEFINITION)


@register
class DenseOffload(Policy):
    name = "dense-offload"
    summary = ("the full KV cache in pinned host memory, streamed to HBM layer by layer each "
               "step with double buffering (layer l+1 copies while layer l computes)")

    def analyze(self, trace: Trace | None, seed: int = 0):
        cost = DecodeCost(resident_frac=0.0, hbm_read_frac=1.0, host_read_frac=1.0,
                          host_frac=1.0, overlap=True, copies_per_layer=2.0, path="h2d",
                          staging_layers=2)
        return self.result(cost, {"kv_read_frac": 1.0, "output_rel_err_mean": 0.0}, DEFINITION)
