"""Dense causal attention with GQA, the reference every policy is measured against."""

from __future__ import annotations

from kvsim._torch import torch


def expand_kv(x: torch.Tensor, n_q_heads: int) -> torch.Tensor:
    """(n_kv, n, d) -> (n_q, n, d): each KV head serves n_q / n_kv consecutive query heads (``x``
    itself when it has n_q heads already)."""
    n_kv = x.shape[0]
    if n_kv == n_q_heads:
        return x
    return x[:, None].expand(n_kv, n_q_heads // n_kv, *x.shape[1:]).reshape(n_q_heads,
                                                                          *x.shape[1:])


def gqa_einsum(equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.einsum(equation, a, expand_kv(b, n_q))`` for ``a`` with n_q heads and ``b`` with
    n_kv (``equation`` "hmd,hnd->hmn", logits, or "hmn,hnd->hmd", values). On one thread it is
    one ``bmm`` per place in the group, bit for bit the einsum's products, without copying ``b``
    to every query head. With more threads BLAS splits a batch of n_q and one of n_kv products
    differently (last bits), and einsum treats a dimension of size 1 apart: both take einsum."""
    n_q, m = a.shape[:2]
    n_kv = b.shape[0]
    if torch.get_num_threads() > 1 or 1 in b.shape[1:]:
        return torch.einsum(equation, a, expand_kv(b, n_q))
    rhs = {"hmd,hnd->hmn": b.transpose(1, 2), "hmn,hnd->hmd": b}[equation]
    g = n_q // n_kv
    out = torch.empty(n_kv, g, m, rhs.shape[-1], dtype=a.dtype, device=a.device)
    grouped = a.unflatten(0, (n_kv, g))
    for j in range(g):
        torch.bmm(grouped[:, j], rhs, out=out[:, j])
    return out.view(n_q, m, rhs.shape[-1])


def logits(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor,
           k_pos: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled logits (n_q, m, n) with -inf where a key lies after its query (causal mask)."""
    s = gqa_einsum("hmd,hnd->hmn", q, k) / q.shape[-1] ** 0.5
    if k_pos is None:  # positions 0..n-1: no row masks a key before its earliest position
        first = min(max(int(q_pos.min()) + 1, 0), k.shape[1]) if q_pos.numel() else k.shape[1]
        k_pos, s_masked = torch.arange(first, k.shape[1], device=k.device), s[..., first:]
    else:
        s_masked = s
    s_masked.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    return s


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                    k_pos: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (n_q, m, d) and log-denominator (n_q, m) of exact causal attention.

    ``q``: (n_q, m, d) queries; ``k``, ``v``: (n_kv, n, d); ``q_pos``: (m,) positions of the
    query rows; a query sees keys at positions <= its own. Computed in the dtype given (pass
    float64 for a reference).
    """
    s = logits(q, k, q_pos, k_pos)
    log_d = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - log_d[..., None])
    return gqa_einsum("hmn,hnd->hmd", p, v), log_d
