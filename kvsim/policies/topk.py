"""Query-agnostic top-k eviction at the same GPU budget (the KVzip / SnapKV family).

Per layer and KV head it keeps exactly ``floor(n_ctx / compression)`` context tokens: the
``sink`` first and ``local`` last tokens plus the highest-scoring others (the budget of the
VerKV paper's baselines: exactly n/compression tokens, sink and local included); the rest
are dropped, never fetched. Attention is exact over the kept tokens and the tokens after the
context.
"""

from __future__ import annotations

from kvsim._torch import torch
from kvsim.attention.sampling import topk_keep
from kvsim.policies.registry import register
from kvsim.policies.scored import ScoredPolicy


@register
class TopK(ScoredPolicy):
    name = "topk"
    summary = ("query-agnostic top-k eviction: keeps sink + local + the best-scored tokens "
               "(1/compression of the cache); the rest are dropped")

    def sample_budget(self, n_ctx):
        p = self.params
        self.budget(n_ctx, need_sample=False)
        return int(n_ctx // p.compression)

    def select(self, scores, budget, generator):
        keep = topk_keep(scores, int(budget), *self.sink_local)
        log_w = torch.zeros(keep.shape, dtype=scores.dtype).masked_fill(~keep, float("-inf"))
        return log_w, keep, 0.0, {}
