"""Causal attention with additive log-weights on the context logits (eviction, sampling and
reweighting all reduce to it: -inf drops a token, log(lambda_i / r_i) reweights a sampled one)."""

from __future__ import annotations

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
    log_d = torch.logsumexp(s, dim=-1)
    p = s.sub_(log_d[..., None]).exp_()
    return gqa_einsum("hmn,hnd->hmd", p, v), log_d


def weighted_attention_chunked(q, q_pos, k, v, log_w_ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`weighted_attention` over row chunks (bounded memory); same result."""
    parts = [weighted_attention(q[:, sl], q_pos[sl], k, v, log_w_ctx)
             for sl in row_chunks(q.shape[0], q.shape[1], k.shape[1])]
    return torch.cat([o for o, _ in parts], 1), torch.cat([ld for _, ld in parts], 1)


def row_chunks(n_q: int, m: int, n: int, budget: int = 1 << 21):
    """Slices over query rows so that one chunk holds about ``budget`` (head, row, token) cells."""
    step = max(1, budget // max(1, n_q * n))
    return [slice(s, min(m, s + step)) for s in range(0, m, step)]
