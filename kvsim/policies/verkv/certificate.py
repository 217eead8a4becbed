"""Shrinkage, the Bernstein certificate and the KVFetch order (VerKV Sections 4.2, App. A.2, B).

Every function works on rows of tokens: tensors ``(..., n)`` whose leading dimensions are
independent decisions (KV head x query head x row); inputs broadcast. Per row: weights ``w``
(shifted, ``exp(s - m)``: every quantity is a ratio, so the shift cancels), inclusion
probabilities ``r`` and the set L (``0 < r < 1``). Per-token constants that only depend on r are
precomputed once per layer (:func:`token_factors`) and are zero outside L, so tokens outside L
(and tokens a row cannot see, whose ``w`` is 0) contribute nothing without any masking.

    MSE(lambda) = (sum_L w (1 - lambda))^2 + sum_L lambda^2 w^2 (1 - r) / r
    eps_hat(L') = [beta + b l / 3 + sqrt((b l / 3)^2 + 2 V l)] / D,   l = ln(2 / delta)
    beta = sum_L' w (1 - lambda), V = sum_L' lambda^2 w^2 (1 - r) / r,
    b = max_L' lambda w / r * max(r, 1 - r)

Sorting: the binary-shrinkage prefix and the fetch order only need the head of a descending
order. With ``head=K`` only the top K are selected (``torch.topk``); rows whose answer lies beyond
the head are recomputed with a full sort, so the result equals ``head=None`` (full sort).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FETCH_HEAD = 4096  # the paper's kernel sorts the top 4096 and falls back to a full sort
SHRINK_HEAD = 512


def log_term(delta: float) -> float:
    return math.log(2.0 / delta)


def bernstein_eps(beta, var, bmax, denom, l: float):
    """eps_hat from the bias ``beta``, variance ``var``, range ``bmax`` and denominator."""
    t = bmax * (l / 3.0)
    return (beta + t + torch.sqrt(t * t + 2.0 * l * var.clamp_min(0.0))) / denom


@dataclass
class Factors:
    """Per-token constants of r (broadcastable to the weights); ``r`` is 1 outside L, the others
    are zero there, so tokens outside L contribute nothing."""
    r: torch.Tensor
    odds: torch.Tensor  # (1 - r) / r
    one_minus_r: torch.Tensor  # 1 - r
    bfac: torch.Tensor  # max(r, 1 - r) / r


def token_factors(r: torch.Tensor, in_l: torch.Tensor) -> Factors:
    zero = torch.zeros((), dtype=r.dtype, device=r.device)
    rr = torch.where(in_l, r, torch.ones((), dtype=r.dtype, device=r.device))
    return Factors(rr,
                   torch.where(in_l, (1 - rr) / rr, zero), torch.where(in_l, 1 - rr, zero),
                   torch.where(in_l, torch.maximum(rr, 1 - rr) / rr, zero))


def _take_rows(x: torch.Tensor, shape, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of ``x`` broadcast to ``shape`` and flattened to (-1, n), without
    materialising the broadcast."""
    lead = shape[:-1]
    idx = torch.unravel_index(rows, lead)
    return x.expand(shape)[idx]


def mse(w: torch.Tensor, r: torch.Tensor, lam: torch.Tensor, in_l: torch.Tensor) -> torch.Tensor:
    """MSE of the shrinkage estimator of D over L (Definition 2, eq. 6)."""
    bias = torch.where(in_l, w * (1 - lam), 0.0).sum(-1)
    var = torch.where(in_l, lam**2 * w**2 * (1 - r) / r, 0.0).sum(-1)
    return bias**2 + var


# ----------------------------------------------------------------------------- shrinkage

@dataclass
class BinaryShrink:
    """lambda_i = r_i on ``idx[..., :count]``, 1 elsewhere (sparse)."""
    idx: torch.Tensor  # (..., K) token indices in visiting order
    count: torch.Tensor  # (...) tokens shrunk
    u: torch.Tensor  # (..., n) w (1 - r) / r, reused for the variance

    def mask(self) -> torch.Tensor:
        sel = torch.arange(self.idx.shape[-1], device=self.idx.device) < self.count[..., None]
        hit = torch.zeros(self.u.shape, dtype=self.u.dtype, device=self.u.device)
        return hit.scatter_add_(-1, self.idx, sel.to(hit.dtype)) > 0

    def lam(self, f: Factors) -> torch.Tensor:
        return torch.where(self.mask(), f.r.expand(self.u.shape), torch.ones_like(self.u))


def binary_shrink(w: torch.Tensor, f: Factors, head: int | None = SHRINK_HEAD) -> BinaryShrink:
    """Appendix A.2: visit L in decreasing ``u_i = w_i (1 - r_i) / r_i`` and set
    ``lambda_i = r_i`` (adding ``a_i = w_i (1 - r_i)`` to beta) while ``u_i > 2 beta``."""
    u = w * f.odds
    shape, n = u.shape, u.shape[-1]

    def prefix(uu, ww, omr, k):
        if k >= n:
            vals, idx = torch.sort(uu, dim=-1, descending=True, stable=True)
        else:
            vals, idx = torch.topk(uu, k, dim=-1)
        a = ww.gather(-1, idx) * omr.expand(uu.shape).gather(-1, idx)
        before = torch.cumsum(a, dim=-1) - a
        return idx, (vals > 2 * before).cumprod(dim=-1).sum(dim=-1)

    k = n if head is None else min(head, n)
    idx, count = prefix(u, w.expand(shape), f.one_minus_r, k)
    if k < n:
        redo = (count == k).reshape(-1).nonzero()[:, 0]
        if redo.numel():
            full_idx, full_count = prefix(u.reshape(-1, n)[redo], _take_rows(w, shape, redo),
                                          _take_rows(f.one_minus_r, shape, redo), n)
            # store the whole order for the redone rows: widen idx to n columns
            wide = torch.cat([idx, torch.zeros(*idx.shape[:-1], n - k, dtype=idx.dtype,
                                               device=idx.device)], -1).reshape(-1, n)
            wide[redo] = full_idx
            # rows not redone keep count < k, so their padding columns are never read
            idx = wide.reshape(*shape[:-1], n)
            count = count.reshape(-1).index_put((redo,), full_count).reshape(count.shape)
    return BinaryShrink(idx, count, u)


def binary_shrinkage(w: torch.Tensor, r: torch.Tensor, in_l: torch.Tensor,
                     head: int | None = SHRINK_HEAD) -> torch.Tensor:
    """Dense lambda (1 outside L) of :func:`binary_shrink`."""
    f = token_factors(r, in_l)
    return binary_shrink(w, f, head).lam(f)


def bounded_shrinkage(w: torch.Tensor, r: torch.Tensor, in_l: torch.Tensor,
                      iters: int | None = None) -> torch.Tensor:
    """Theorem 1: the unique MSE minimiser over the box, ``lambda_i = clip_[r_i, 1](beta r_i /
    (w_i (1 - r_i)))`` with ``beta = sum_L w_i (1 - lambda_i)``. The right side of the beta
    equation decreases in beta and the left side increases: bisection on beta in
    ``[0, sum_L w_i (1 - r_i)]`` (``iters`` halvings; default: enough for the dtype)."""
    w, r, in_l = torch.broadcast_tensors(w, r, in_l)
    iters = iters or (64 if w.dtype == torch.float64 else 32)
    u = torch.where(in_l, w * (1 - r) / r, torch.zeros_like(w))
    tiny = torch.finfo(u.dtype).tiny

    def lam_of(beta):
        ratio = torch.where(u > 0, beta[..., None] / u.clamp_min(tiny),
                            torch.full_like(u, float("inf")))
        return torch.where(in_l, torch.minimum(torch.maximum(ratio, r), torch.ones_like(r)),
                           torch.ones_like(r))

    hi = torch.where(in_l, w * (1 - r), 0.0).sum(-1)
    lo = torch.zeros_like(hi)
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        excess = torch.where(in_l, w * (1 - lam_of(mid)), 0.0).sum(-1) - mid
        lo = torch.where(excess > 0, mid, lo)
        hi = torch.where(excess > 0, hi, mid)
    return lam_of(0.5 * (lo + hi))


# --------------------------------------------------------------------------- certificate

def terms(w: torch.Tensor, f: Factors, lam: torch.Tensor | BinaryShrink):
    """Per-token contributions (beta_i, V_i, b_i), zero outside L. ``lam`` dense, or the sparse
    binary form (then only the shrunk tokens are patched)."""
    if isinstance(lam, BinaryShrink):
        var_i = w * lam.u  # lambda = 1: w^2 (1 - r) / r
        b_i = w * f.bfac
        shape = var_i.shape
        sel = torch.arange(lam.idx.shape[-1], device=w.device) < lam.count[..., None]
        r_at = f.r.expand(shape).gather(-1, lam.idx)
        scale = torch.where(sel, r_at, torch.ones_like(r_at))
        # multiplicative / additive patches, so padded duplicate indices (scale 1, a 0) are no-ops
        var_i.scatter_reduce_(-1, lam.idx, scale * scale, reduce="prod")
        b_i.scatter_reduce_(-1, lam.idx, scale, reduce="prod")
        a_at = w.expand(shape).gather(-1, lam.idx) * f.one_minus_r.expand(shape).gather(
            -1, lam.idx)
        beta_i = torch.zeros_like(var_i).scatter_add_(-1, lam.idx, torch.where(sel, a_at, 0.0))
        return beta_i, var_i, b_i
    lw = lam * w
    return w * (1 - lam) * (f.odds > 0), lw * lw * f.odds, lw * f.bfac


def eps_hat(w, r, lam, in_l, denom, delta: float) -> torch.Tensor:
    """Lemma 1's eps_hat(L) over the tokens in ``in_l`` (0 for an empty set)."""
    beta_i, var_i, b_i = terms(w, token_factors(r, in_l), lam)
    return bernstein_eps(beta_i.sum(-1), var_i.sum(-1), b_i.amax(-1), denom, log_term(delta))


@dataclass
class FetchPlan:
    k_star: torch.Tensor  # (...) tokens of L made exact by this decision
    exact: torch.Tensor  # (..., n) bool: L_g[:k*]
    eps_before: torch.Tensor  # (...) eps_hat(L)
    eps_after: torch.Tensor  # (...) eps_hat(L_g[k*:])
    order: torch.Tensor  # (..., K) the head of L_g (K = n for a full sort)


def output_terms(eps_out: float, delta: float, head_dim: int) -> tuple[float, float]:
    """(threshold, log term) of the output certificate at ``eps_out``: per value dimension j and
    for D, Lemma 1 at delta / (d + 1) each (a union bound over d + 1 events) gives
    ``|o^_j - o_j| <= R_j e' / (1 - e')`` with ``e' = eps_hat`` at ``l' = ln(2 (d + 1) / delta)``
    and ``R_j`` the range of value dimension j (every term of the numerator is a term of D times
    ``v_ij - o_j``, and ``|v_ij - o_j| <= R_j``). So ``||o^ - o|| <= eps_out ||R||`` when
    ``e' <= eps_out / (1 + eps_out)``."""
    return eps_out / (1.0 + eps_out), math.log(2.0 * (head_dim + 1) / delta)


def output_eps(eps_prime):
    """The output certificate ``e' / (1 - e')`` (inf where ``e' >= 1``)."""
    return torch.where(eps_prime < 1, eps_prime / (1 - eps_prime).clamp_min(1e-300),
                       torch.full_like(eps_prime, float("inf")))


def fetch_plan_terms(beta_i, var_i, b_i, denom, eps: float, delta: float,
                     head: int | None = FETCH_HEAD,
                     also: tuple[float, float] | None = None) -> FetchPlan:
    """KVFetch steps 3-5 from per-token terms: order L by ``g_i = eps_hat(L) - eps_hat(L \\ {i})``
    descending, take the smallest k with ``eps_hat(L_g[k:]) < eps``. Suffix sums (beta, V) and a
    suffix max (b) give every k at once. Tokens with all-zero terms (outside L, invisible, or
    underflowed) are never made exact. ``also`` = (threshold, log term): a second condition the
    cut must meet (the output certificate, :func:`output_terms`); the order then uses its log
    term, the larger one."""
    l = log_term(delta) if also is None else max(log_term(delta), also[1])
    shape, n = beta_i.shape, beta_i.shape[-1]
    denom = torch.broadcast_to(denom, shape[:-1])
    beta, var = beta_i.sum(-1), var_i.sum(-1)
    top = torch.topk(b_i, min(2, n), dim=-1)
    bmax = top.values[..., 0]
    second = top.values[..., 1] if n > 1 else torch.zeros_like(bmax)
    # D * g_i = beta_i + sqrt(c1) - sqrt(c1 - 2 l V_i), written without cancellation; b is
    # held at bmax for every token but the argmax of b, which is corrected below
    t = bmax * (l / 3.0)
    t2 = second * (l / 3.0)
    c1 = t * t + 2.0 * l * var
    root1 = torch.sqrt(c1)[..., None]
    x = (2.0 * l) * var_i
    gain = beta_i + x / (root1 + torch.sqrt((c1[..., None] - x).clamp_min(0.0))).clamp_min(
        torch.finfo(x.dtype).tiny)
    arg = top.indices[..., :1]
    c2 = (t2 * t2)[..., None] + 2.0 * l * (var[..., None] - var_i.gather(-1, arg)).clamp_min(0.0)
    gain_arg = beta_i.gather(-1, arg) + (t - t2)[..., None] + (c1[..., None] - c2) / (
        root1 + torch.sqrt(c2)).clamp_min(torch.finfo(x.dtype).tiny)
    gain.scatter_(-1, arg, gain_arg)

    def evaluate(g, bi, vi, bb, tot_beta, tot_var, d, k):
        if k >= n:
            _, idx = torch.sort(g, dim=-1, descending=True, stable=True)
        else:
            idx = torch.topk(g, k, dim=-1).indices
        hb, hv, hm = bi.gather(-1, idx), vi.gather(-1, idx), bb.gather(-1, idx)
        zero = torch.zeros_like(hb[..., :1])
        # suffix sums over the head by reversed cumsums (exactly 0 past the last token, however
        # small eps), plus the tail (the tokens outside the head) as total minus head
        if k >= n:
            tail_beta = tail_var = tail_b = zero
        else:
            tail_beta = (tot_beta[..., None] - hb.sum(-1, keepdim=True)).clamp_min(0)
            tail_var = (tot_var[..., None] - hv.sum(-1, keepdim=True)).clamp_min(0)
            in_head = torch.zeros(bb.shape, dtype=torch.bool, device=bb.device).scatter_(
                -1, idx, True)
            tail_b = bb.masked_fill(in_head, 0.0).amax(-1, keepdim=True)
        suf_beta = torch.cat([hb.flip(-1).cumsum(-1).flip(-1), zero], -1) + tail_beta
        suf_var = torch.cat([hv.flip(-1).cumsum(-1).flip(-1), zero], -1) + tail_var
        suf_b = torch.cat([hm.flip(-1).cummax(-1).values.flip(-1), zero], -1).maximum(tail_b)
        eps_k = bernstein_eps(suf_beta, suf_var, suf_b, d[..., None], log_term(delta))
        ok = eps_k < eps  # (..., k + 1)
        if also is not None:
            ok &= bernstein_eps(suf_beta, suf_var, suf_b, d[..., None], also[1]) < also[0]
        found = ok.any(-1)
        k_star = ok.int().argmax(-1)
        live = (hb > 0) | (hv > 0) | (hm > 0)  # tokens with no contribution are never fetched
        sel = (torch.arange(idx.shape[-1], device=idx.device) < k_star[..., None]) & live
        exact = torch.zeros(bb.shape, dtype=torch.bool, device=bb.device).scatter_(-1, idx, sel)
        after = eps_k.gather(-1, k_star[..., None])[..., 0]
        return FetchPlan(k_star, exact, eps_k[..., 0], after, idx), found

    k = n if head is None else min(head, n)
    plan, found = evaluate(gain, beta_i, var_i, b_i, beta, var, denom, k)
    if k < n and not bool(found.all()):
        redo = (~found).reshape(-1).nonzero()[:, 0]
        flat = lambda x: x.reshape(-1, n)[redo]  # noqa: E731
        full, _ = evaluate(flat(gain), flat(beta_i), flat(var_i), flat(b_i),
                           beta.reshape(-1)[redo], var.reshape(-1)[redo],
                           denom.reshape(-1)[redo], n)
        lead = shape[:-1]
        for name in ("k_star", "eps_before", "eps_after"):
            v = getattr(plan, name).reshape(-1).clone()
            v[redo] = getattr(full, name)
            setattr(plan, name, v.reshape(lead))
        ex = plan.exact.reshape(-1, n).clone()
        ex[redo] = full.exact
        plan.exact = ex.reshape(shape)
        plan.order = None  # rows differ in length; the exact mask is the result
    return plan


def fetch_plan(w, r, lam, in_l, denom, eps: float, delta: float,
               head: int | None = FETCH_HEAD) -> FetchPlan:
    """KVFetch with a dense lambda (see :func:`fetch_plan_terms`)."""
    return fetch_plan_terms(*terms(w, token_factors(r, in_l), lam), denom, eps, delta, head)


def gqa_union(mask: torch.Tensor, n_kv: int) -> torch.Tensor:
    """(n_q, m, n) per-query-head token masks -> (n_kv, m, n): the union over the query heads
    that share each KV head (head j serves query heads j*g .. (j+1)*g - 1)."""
    n_q = mask.shape[0]
    return mask.reshape(n_kv, n_q // n_kv, *mask.shape[1:]).any(dim=1)
