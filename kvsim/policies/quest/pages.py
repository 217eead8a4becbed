"""Quest's page maths: the channel-wise key bounds of each page and the selection of the pages
with the highest upper bound on a query's logit (the policy and its decide bench share them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvsim._torch import torch


@dataclass
class Pages:
    """What Quest keeps of one layer: per KV head the pages' key bounds, and the resident
    tokens (sink and local)."""
    k_min: torch.Tensor  # (n_kv, pages, d)
    k_max: torch.Tensor
    resident: torch.Tensor  # (n_kv, n_ctx) bool
    page_size: int
    n_ctx: int


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


def select(q: torch.Tensor, q_pos: torch.Tensor, state: Pages, budget_pages: int) -> torch.Tensor:
    """(n_kv, m, n_ctx) bool: the tokens of the pages each row of each KV head reads: the
    ``budget_pages`` pages with the highest upper bound on the logit over the group's query
    heads, among the pages that start at or before the row's position."""
    n_q, m, d = q.shape
    n_kv, pages, _ = state.k_min.shape
    g = n_q // n_kv
    kmin = state.k_min.repeat_interleave(g, 0).to(q.dtype)
    kmax = state.k_max.repeat_interleave(g, 0).to(q.dtype)
    bound = (torch.einsum("hmd,hpd->hmp", q.clamp_min(0), kmax)
             + torch.einsum("hmd,hpd->hmp", q.clamp_max(0), kmin)) / math.sqrt(d)
    bound = bound.view(n_kv, g, m, pages).amax(1)  # (n_kv, m, pages)
    start = torch.arange(pages, device=q.device) * state.page_size
    bound = bound.masked_fill(start[None, None, :] > q_pos[None, :, None], float("-inf"))
    top = bound.topk(min(budget_pages, pages), dim=-1)
    chosen = torch.zeros_like(bound, dtype=torch.bool).scatter_(
        -1, top.indices, top.values > float("-inf"))
    return chosen.repeat_interleave(state.page_size, -1)[..., :state.n_ctx]
