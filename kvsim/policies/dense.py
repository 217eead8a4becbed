"""The two dense baselines: the whole cache in HBM, or the whole cache in host memory."""

from __future__ import annotations

from kvsim._torch import torch
from kvsim.attention.dense import dense_attention
from kvsim.contract import DecodeCost
from kvsim.policies.base import Compressed, FetchPolicy, MaskPolicy, Reads
from kvsim.policies.registry import register


@register
class DenseResident(MaskPolicy):
    name = "dense-resident"
    summary = "the full KV cache in HBM; attention reads all of it each step"

    def attend(self, state, q, q_pos, k, v):
        return dense_attention(q, k, v, q_pos)[0], {}

    def decode_cost(self, stats, model):
        return DecodeCost(resident_frac=1.0, hbm_read_frac=1.0, host_read_frac=0.0,
                          host_frac=0.0, overlap=False)

    def definition_stats(self):
        return {"kv_read_frac": 0.0, "output_rel_err_mean": 0.0}


@register
class DenseOffload(FetchPolicy):
    name = "dense-offload"
    summary = ("the full KV cache in pinned host memory, streamed to HBM layer by layer each "
               "step with double buffering (layer l+1 copies while layer l computes)")

    def compress(self, k, v, scores, obs_q, obs_pos, generator, layer, obs_k=None):
        return Compressed(k.shape[1], 0.0, 0.0)  # nothing stays in HBM between steps

    def attend(self, n_ctx, q, q_pos, k, v):
        out, _ = dense_attention(q, k, v, q_pos)
        return out, {}, Reads(torch.ones(k.shape[0], n_ctx, dtype=torch.bool, device=k.device))

    def decode_cost(self, stats, model):
        return DecodeCost(resident_frac=0.0, hbm_read_frac=1.0, host_read_frac=1.0,
                          host_frac=1.0, overlap=True, copies_per_layer=2.0, path="h2d",
                          staging_layers=2)

    def definition_stats(self):
        return {"kv_read_frac": 1.0, "output_rel_err_mean": 0.0}
