"""Query-agnostic top-k eviction at the same GPU budget (the KVzip / SnapKV family).

Per layer and KV head it keeps exactly ``floor(n_ctx / compression)`` context tokens: the
``sink`` first and ``local`` last tokens plus the highest-scoring others (spec point 6); the rest
are dropped, never fetched. Attention is exact over the kept tokens and the tokens after the
context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvsim.kernels.poisson import topk_keep
from kvsim.kernels.weighted import row_chunks, weighted_attention
from kvsim.policies import _measure as M
from kvsim.policies.base import DecodeCost, Policy, register
from kvsim.trace import Trace


@dataclass
class TopKState:
    keep: torch.Tensor  # (n_kv, n_ctx) bool
    held_tokens: float  # per KV head
    held_bytes: float  # per KV head


@register
class TopK(Policy):
    name = "topk"
    Params = M.NoFetchParams
    needs_attention = True
    summary = ("query-agnostic top-k eviction: keeps sink + local + the best-scored tokens "
               "(1/compression of the cache); the rest are dropped")

    def compress(self, k, v, scores, obs_q, obs_pos, generator, layer):
        p = self.params
        n_kv, n_ctx, d = k.shape
        M.check_budget(self.name, n_ctx, p.compression, p.sink, p.local, need_sample=False)
        budget = int(n_ctx // p.compression)
        s = M.context_scores(scores, p.scorer, k, obs_q, obs_pos)
        keep = topk_keep(s, budget, p.sink, p.local)
        held = float(keep.sum(-1).to(torch.float64).mean())
        return TopKState(keep, held, held * 2 * d * M.KV_ELEM_BYTES)

    def attend(self, state, q, q_pos, k, v):
        log_w = torch.zeros(state.keep.shape, dtype=q.dtype, device=q.device)
        log_w = log_w.masked_fill(~state.keep, float("-inf"))
        log_w = log_w.repeat_interleave(q.shape[0] // k.shape[0], dim=0)[:, None, :]
        outs, logds = [], []
        for sl in row_chunks(q.shape[0], q.shape[1], k.shape[1]):
            o, ld = weighted_attention(q[:, sl], q_pos[sl], k, v, log_w)
            outs.append(o)
            logds.append(ld)
        return torch.cat(outs, 1), {"log_denominator": torch.cat(logds, 1)}

    def analyze(self, trace: Trace | None, seed: int = 0):
        M.require_attention(trace, self.name)
        stats = M.measure(self, trace, seed)
        res = stats["resident_frac"]
        cost = DecodeCost(resident_frac=res, hbm_read_frac=res, host_read_frac=0.0,
                          host_frac=0.0, overlap=False, copies_per_layer=0.0)
        return self.result(cost, stats, M.provenance(trace, self.name, seed))
