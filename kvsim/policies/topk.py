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
from kvsim.kernels.weighted import weighted_attention_chunked
from kvsim.policies import _measure as M
from kvsim.policies.base import Policy, register
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
        out, log_d = weighted_attention_chunked(q, q_pos, k, v, log_w)
        return out, {"log_denominator": log_d}

    def analyze(self, trace: Trace | None, seed: int = 0):
        return M.analyze_no_fetch(self, trace, seed)
