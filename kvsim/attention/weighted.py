"""Causal attention with additive log-weights on the context logits (eviction, sampling and
reweighting all reduce to it: -inf drops a token, log(lambda_i / r_i) reweights a sampled one)."""

from __future__ import annotations

import math

from kvsim._torch import torch
from kvsim.attention.dense import gqa_einsum, logits


def weighted_attention(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       log_w_ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (n_q, m, d) and log-denominator (n_q, m) of attention over all keys ``k``, ``v``
    (n_kv, n, d), with ``log_w_ctx`` (broadcastable to (n_q, m, n_ctx)) added to the logits of
    the first n_ctx (context) tokens; later tokens keep weight 1. Causal as ``logits``."""
    return weighted_from_logits(logits(q, k, q_pos), log_w_ctx, v)


def weighted_from_logits(s: torch.Tensor, log_w_ctx: torch.Tensor,
                         v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`weighted_attention` from its logits ``s`` (n_q, m, n), which it overwrites, and
    the values ``v`` (n_kv, n, d)."""
    n_ctx = log_w_ctx.shape[-1]
    s[..., :n_ctx] += log_w_ctx
    log_d = logsumexp(s)
    s.sub_(log_d[..., None])
    # log_d finite: s is finite or -inf (a NaN or +inf would make it NaN or +inf)
    p = _exp_finite(s) if _fast(s) and bool(log_d.isfinite().all()) else s.exp_()
    return gqa_einsum("hmn,hnd->hmd", p, v), log_d


def _fast(s: torch.Tensor) -> bool:
    return s.dtype in (torch.float32, torch.float64) and s.shape[-1] > 0


def _exp_finite(t: torch.Tensor) -> torch.Tensor:
    """``t.exp_()`` for ``t`` of finite or -inf entries, bit for bit: the vectorised exp takes
    a ~10x slower path on -inf (as on any value under about -87), and masked tokens make most
    entries -inf; they go through exp as 0 and their exp (0) is put back by a product with 0."""
    live = (t - t).nan_to_num_(nan=-1.0).add_(1.0)  # 1 where finite, 0 at -inf (-inf - -inf: nan)
    return t.nan_to_num_(neginf=0.0).exp_().mul_(live)


def logsumexp(s: torch.Tensor) -> torch.Tensor:
    """``torch.logsumexp(s, dim=-1)``, bit for bit, in its steps (the rows' max, 0 where it is
    infinite, exp(s - max) summed, log, plus the max) with the exp of :func:`_exp_finite`; rows
    with a NaN or +inf, and other dtypes than float32 and float64, take torch.logsumexp."""
    if not _fast(s):
        return torch.logsumexp(s, dim=-1)
    top = s.amax(-1, keepdim=True)
    if not bool((top < math.inf).all()):
        return torch.logsumexp(s, dim=-1)
    top.masked_fill_(top == -math.inf, 0.0)
    return _exp_finite(s - top).sum(-1).log_().add_(top[..., 0])


def weighted_attention_chunked(q, q_pos, k, v, log_w_ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`weighted_attention` over row chunks (bounded memory); same result."""
    parts = [weighted_attention(q[:, sl], q_pos[sl], k, v, log_w_ctx)
             for sl in row_chunks(q.shape[0], q.shape[1], k.shape[1])]
    return torch.cat([o for o, _ in parts], 1), torch.cat([ld for _, ld in parts], 1)


def row_chunks(n_q: int, m: int, n: int, budget: int = 1 << 21):
    """Slices over query rows so that one chunk holds about ``budget`` (head, row, token) cells."""
    step = max(1, budget // max(1, n_q * n))
    return [slice(s, min(m, s + step)) for s in range(0, m, step)]
