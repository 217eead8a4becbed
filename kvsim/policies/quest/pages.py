"""Quest's page maths: the channel-wise key bounds of each page and the upper bound they give on a
query's logit, by which :func:`select` ranks the pages (the policy and its decide bench share
it through :class:`kvsim.policies.blocks.BlockFetchPolicy`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvsim._torch import torch
from kvsim.policies.blocks import BlockState, top_blocks


@dataclass
class Pages:
    """Quest's index of one layer: per KV head and page the channel-wise key bounds."""
    k_min: torch.Tensor  # (n_kv, pages, d)
    k_max: torch.Tensor


def page_bounds(k: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel-wise min and max of the keys (n_kv, n, d) per page of ``page_size`` tokens (the
    last page may be partial): (n_kv, pages, d) each."""
    n_kv, n, d = k.shape
    pages = math.ceil(n / page_size)
    pad = pages * page_size - n
    kp = torch.nn.functional.pad(k, (0, 0, 0, pad), value=float("nan")).view(n_kv, pages,
                                                                             page_size, d)
    return (torch.nan_to_num(kp, nan=float("inf")).amin(2),
            torch.nan_to_num(kp, nan=float("-inf")).amax(2))


def upper_bounds(q: torch.Tensor, pages: Pages) -> torch.Tensor:
    """(n_kv, m, pages): the upper bound on the logit of any key of each page, the largest over
    the query heads (``q``: (n_q, m, d)) of each KV head (the bound for any of them)."""
    n_q, m, d = q.shape
    n_kv, n_pages, _ = pages.k_min.shape
    g = n_q // n_kv
    kmin = pages.k_min.repeat_interleave(g, 0).to(q.dtype)
    kmax = pages.k_max.repeat_interleave(g, 0).to(q.dtype)
    bound = (torch.einsum("hmd,hpd->hmp", q.clamp_min(0), kmax)
             + torch.einsum("hmd,hpd->hmp", q.clamp_max(0), kmin)) / math.sqrt(d)
    return bound.view(n_kv, g, m, n_pages).amax(1)


def select(q: torch.Tensor, q_pos: torch.Tensor, state: BlockState,
           budget_pages: int) -> torch.Tensor:
    """(n_kv, m, n_ctx) bool: the tokens of the pages each row of each KV head reads: the
    ``budget_pages`` pages with the highest upper bound on the logit over the group's query
    heads, among the pages that start at or before the row's position."""
    return top_blocks(upper_bounds(q, state.index), q_pos, state, budget_pages)
