"""Quest's page selection as a fetching policy.

The context is cut into pages of ``page_size`` tokens. Per page and KV head the GPU keeps the
channel-wise minimum and maximum of the keys (fp16): for a query ``q`` no key of the page has a
logit above ``sum_j max(q_j min_j, q_j max_j) / sqrt(d)``. Each decision ranks the pages by that
bound and reads the best ``token_budget / page_size`` of them (K and V) from host memory;
attention is exact over them, the ``sink`` and ``local`` tokens kept in HBM, and the tokens after
the context. With GQA the query heads of a KV head share its fetch: a page's bound is the largest
over the group's query heads (the upper bound for any of them), so each KV head reads exactly the
budget, whatever the context: the fetch is a fixed token count, charged as such.

Quest itself keeps the cache on the GPU and skips the first layers; here every layer selects,
and the pages come over the host link (the offload setting of the other fetching policies).
A question pass (several rows) reads the union of its rows' pages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvsim._torch import torch
from kvsim.attention.weighted import row_chunks, weighted_attention
from kvsim.contract import DecodeCost, kv_token_bytes
from kvsim.errors import KvsimError
from kvsim.policies import options as O
from kvsim.policies.base import KV_ELEM_BYTES, Compressed, FetchPolicy, Reads
from kvsim.policies.quest.pages import Pages, page_bounds, select
from kvsim.policies.registry import register

META_BYTES = 2  # fp16 min and max per page, channel and KV head


@dataclass
class QuestParams:
    page_size: int = field(default=16, metadata={
        "kind": int, "help": "tokens per page: the unit Quest bounds and fetches"})
    token_budget: int = field(default=1024, metadata={
        "kind": int, "help": "context tokens each KV head reads per step (whole pages: the "
                             "best token_budget / page_size), whatever the context"})
    sink: int = O.shared("sink", 4)
    local: int = O.shared("local", 4)

    def validate(self) -> None:
        for name in ("page_size", "token_budget"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and int(v) == v and v >= 1):
                raise KvsimError(f"--{name.replace('_', '-')} must be a whole number >= 1; "
                                 f"got {v}")
        if self.token_budget < self.page_size:
            raise KvsimError(f"--token-budget ({self.token_budget}) holds no page of "
                             f"--page-size {self.page_size}")


@register
class Quest(FetchPolicy):
    name = "quest"
    Params = QuestParams
    needs_attention = True
    summary = ("per page of keys their channel-wise min/max on the GPU, the cache in host "
               "memory; each step fetches the pages with the highest bound on q.k within a "
               "fixed token budget")

    def compress(self, k, v, scores, obs_q, obs_pos, generator, layer, obs_k=None):
        p = self.params
        n_kv, n_ctx, d = k.shape
        pos = torch.arange(n_ctx, device=k.device)
        resident = ((pos < p.sink) | (pos >= n_ctx - p.local)).expand(n_kv, n_ctx)
        k_min, k_max = page_bounds(k, p.page_size)
        meta = 2 * k_min.shape[1] * d * META_BYTES  # per KV head
        held = float(resident.sum(-1).to(torch.float64).mean())
        return Compressed(Pages(k_min, k_max, resident, p.page_size, n_ctx), held,
                          held * 2 * d * KV_ELEM_BYTES + meta, meta, resident=resident)

    def attend(self, state: Pages, q, q_pos, k, v):
        n_q, m, d = q.shape
        n_kv, n_ctx = state.resident.shape
        g = n_q // n_kv
        budget = self.params.token_budget // self.params.page_size
        outs, logds, rows = [], [], []
        read = torch.zeros(n_kv, n_ctx, dtype=torch.bool, device=q.device)
        for sl in row_chunks(n_q, m, k.shape[1]):
            qc, pc = q[:, sl], q_pos[sl]
            pages = select(qc, pc, state, budget)  # (n_kv, mc, n_ctx)
            fetched = pages & ~state.resident[:, None]
            read |= fetched.any(1)
            keep = (pages | state.resident[:, None]).repeat_interleave(g, 0)
            log_w = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(
                ~keep, float("-inf"))
            o, ld = weighted_attention(qc, pc, k, v, log_w)
            outs.append(o)
            logds.append(ld)
            tokens = fetched.sum(-1).repeat_interleave(g, 0).to(q.dtype)
            rows.append({"fetch": tokens > 0, "fetched_tokens": tokens,
                         "kvhead_fetch": tokens > 0})
        stats = {key: torch.cat([r[key] for r in rows], 1) for key in rows[0]}
        stats["log_denominator"] = torch.cat(logds, 1)
        return torch.cat(outs, 1), stats, Reads(read)

    def decide_kernel(self, device, model, context, seed=0):
        from kvsim.policies.quest.bench import QuestBench
        return QuestBench(device, model, context, seed, self.params)

    def decode_cost(self, stats, model):
        """The fetch is ``token_budget`` tokens of K and V per KV head and step (fewer where
        the context is shorter: the simulator caps every term at the context); sink and local
        stay in HBM with the page bounds of ``model``'s keys (two fp16 keys per page: a share
        of the cache, 1/page_size of a 16-bit one), which the decide step reads each step."""
        p = self.params
        bounds = 2 * model.head_dim * META_BYTES / p.page_size  # per context token, KV head
        meta = bounds / kv_token_bytes(model)
        kept = float(p.sink + p.local)
        return DecodeCost(resident_frac=meta, hbm_read_frac=meta, host_read_frac=0.0,
                          host_frac=1.0, overlap=False, copies_per_layer=1.0, path="gather",
                          staging_layers=1, decide_bytes_per_token=bounds, meta_frac=meta,
                          decide_kernel=self.name,
                          resident_tokens=kept, hbm_read_tokens=kept + p.token_budget,
                          host_read_tokens=float(p.token_budget))

    def provenance(self, stats):
        return (f"Quest's fetch is {self.params.token_budget} tokens per KV head and step by "
                f"definition (charged as a fixed count at any context); the trace measures its "
                f"error")
