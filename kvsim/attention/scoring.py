"""Query-agnostic token importance scores per KV head, and their mapping to ``tau`` in (0, 1].

* :func:`attention_mass`: mean softmax attention of some query rows over the keys, aggregated
  (mean) over the query heads of each KV head. With the trace's future question and decode rows
  this is the ``oracle`` scorer (an upper bound: it looks at the queries eviction cannot see).
* :func:`snapkv_scores`: SnapKV-style, the attention mass of the observation window (the last
  question rows) smoothed by a length-5 average pool along the tokens; as in SnapKV, the window's
  softmax runs over every key it sees, its own (question) tokens included.
* :func:`to_tau`: any score into (0, 1] with a floor, so that no token gets ``r_i = 0``
  (a token with ``r_i = 0`` would silently leave the estimator and the certificate).
"""

from __future__ import annotations

from kvsim._torch import F, torch
from kvsim.attention.dense import logits

SNAPKV_POOL = 5
# tau floor relative to the mean tau of the candidates (keeps every r_i > 0). With a kept
# fraction near 1/16 this gives r_i >= ~6e-5: a floored token is almost never sampled, and
# binary shrinkage gives it lambda_i = r_i, i.e. the certificate charges it as bias (fetch if
# it matters).
TAU_FLOOR_REL = 1e-3


def attention_mass(k: torch.Tensor, q: torch.Tensor, q_pos: torch.Tensor,
                   k_pos: torch.Tensor | None = None,
                   k_after: torch.Tensor | None = None) -> torch.Tensor:
    """(n_kv, n): softmax attention of the rows ``q`` (n_q, m, d) on the keys ``k``
    (n_kv, n, d), mean over the m rows and over the query heads of each KV head. The softmax
    runs over ``k`` only, or with ``k_after`` (n_kv, a, d: the keys at positions n .. n+a-1) over
    those too, as far as each row sees; only the mass on ``k`` is returned.

    Rows are processed in chunks so that memory stays bounded on long contexts.
    """
    n_kv, n, _ = k.shape
    if k_after is not None and k_after.shape[1]:
        k_pos = torch.arange(n + k_after.shape[1], device=k.device)
        k = torch.cat([k, k_after.to(k.dtype)], 1)
    n_q, m, _ = q.shape
    if m == 0:
        raise ValueError("attention_mass needs at least one query row")
    total = torch.zeros(n_q, n, dtype=q.dtype, device=q.device)
    chunk = max(1, (1 << 22) // max(1, n_q * n))
    for s in range(0, m, chunk):
        lg = logits(q[:, s:s + chunk], k, q_pos[s:s + chunk], k_pos)
        total += torch.softmax(lg, dim=-1).nan_to_num(0.0)[..., :n].sum(dim=1)
    return (total / m).view(n_kv, n_q // n_kv, n).mean(dim=1)


def snapkv_scores(k: torch.Tensor, obs_q: torch.Tensor, obs_pos: torch.Tensor,
                  pool: int = SNAPKV_POOL, k_after: torch.Tensor | None = None) -> torch.Tensor:
    """SnapKV scores (n_kv, n) of the context keys ``k``: attention mass of the observation
    window, average-pooled over ``pool`` neighbouring tokens (stride 1, same length, padding not
    counted). ``k_after``: the keys after the context (the window's question tokens), which the
    window's softmax includes where a row sees them."""
    mass = attention_mass(k, obs_q, obs_pos, k_after=k_after)
    if pool <= 1:
        return mass
    return F.avg_pool1d(mass[:, None, :], pool, stride=1, padding=pool // 2,
                        count_include_pad=False)[:, 0, : mass.shape[-1]]


def to_tau(scores: torch.Tensor, floor_rel: float = TAU_FLOOR_REL) -> torch.Tensor:
    """Scores (h, n) -> tau in (0, 1] per row.

    Non-negative scores are divided by their row maximum; scores with negative entries (logits,
    log-probabilities) go through a softmax first. Then ``tau >= floor_rel * mean(tau)``, so every
    token keeps ``r_i > 0`` (the scale of tau does not matter: ``c`` absorbs it).
    """
    s = scores.to(torch.float64 if scores.dtype == torch.float64 else torch.float32)
    if (s < 0).any():
        s = torch.softmax(s, dim=-1)
    top = s.amax(dim=-1, keepdim=True)
    tau = torch.where(top > 0, s / top.clamp_min(torch.finfo(s.dtype).tiny), torch.ones_like(s))
    floor = floor_rel * tau.mean(dim=-1, keepdim=True)
    return tau.clamp_min(floor).clamp_max(1.0)
