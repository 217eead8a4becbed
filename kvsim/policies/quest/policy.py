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

from kvsim.errors import KvsimError
from kvsim.policies import options as O
from kvsim.policies.blocks import BlockFetchPolicy
from kvsim.policies.quest.pages import Pages, page_bounds
from kvsim.policies.quest.pages import select as select_pages
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
class Quest(BlockFetchPolicy):
    """Pages of ``page_size`` tokens, indexed by their key bounds; ``token_budget`` tokens of the
    best pages per step (:class:`~kvsim.policies.blocks.BlockFetchPolicy` does the rest: the
    resident set, attention, the statistics, the cost and the decide bench)."""
    name = "quest"
    Params = QuestParams
    summary = ("per page of keys their channel-wise min/max on the GPU, the cache in host "
               "memory; each step fetches the pages with the highest bound on q.k within a "
               "fixed token budget")

    @property
    def block_size(self) -> int:
        return self.params.page_size

    def index(self, k):
        return Pages(*page_bounds(k, self.params.page_size))

    def block_bytes(self, model):
        """Two fp16 keys per page (min and max): 1/page_size of a 16-bit cache."""
        return 2 * model.head_dim * META_BYTES

    def select(self, state, q, q_pos, budget):
        return select_pages(q, q_pos, state, budget)

    def provenance(self, stats):
        return (f"Quest's fetch is {self.params.token_budget} tokens per KV head and step by "
                f"definition (charged as a fixed count at any context); the trace measures its "
                f"error")
