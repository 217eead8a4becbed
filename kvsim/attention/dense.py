"""Dense causal attention with GQA, the reference every policy is measured against."""

from __future__ import annotations

from kvsim._torch import torch


def expand_kv(x: torch.Tensor, n_q_heads: int) -> torch.Tensor:
    """(n_kv, n, d) -> (n_q, n, d): each KV head serves n_q / n_kv consecutive query heads (``x``
    itself when it has n_q heads already)."""
    if x.shape[0] == n_q_heads:
        return x
    return x.repeat_interleave(n_q_heads // x.shape[0], dim=0)


def logits(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor,
           k_pos: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled logits (n_q, m, n) with -inf where a key lies after its query (causal mask)."""
    k_pos = torch.arange(k.shape[1], device=k.device) if k_pos is None else k_pos
    s = torch.einsum("hmd,hnd->hmn", q, expand_kv(k, q.shape[0])) / q.shape[-1] ** 0.5
    return s.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))


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
    return torch.einsum("hmn,hnd->hmd", p, expand_kv(v, q.shape[0])), log_d
